# Writes OUT, a C++ source defining `const std::string_view NAME` (namespace NAMESPACE) with the bytes of IN as a raw
# string literal. Run as `cmake -DIN=... -DOUT=... -DNAME=... -DNAMESPACE=... -P embed_text.cmake`.
file(READ "${IN}" text)
string(FIND "${text}" ")MOECORE_TEXT\"" clash)
if(NOT clash EQUAL -1)
  message(FATAL_ERROR "${IN} holds the raw string delimiter )MOECORE_TEXT\"")
endif()
file(WRITE "${OUT}.tmp" "// Generated from ${IN} by cmake/embed_text.cmake.\n#include <string_view>\n\nnamespace ${NAMESPACE} {\nextern const std::string_view ${NAME};\nconst std::string_view ${NAME} = R\"MOECORE_TEXT(${text})MOECORE_TEXT\";\n}  // namespace ${NAMESPACE}\n")
file(RENAME "${OUT}.tmp" "${OUT}")
