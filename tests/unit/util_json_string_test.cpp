// json_string: JSON string literals as Python's json.dumps writes them (the GPT dataset's description, whose hash
// names its index caches, and the trace's names).
#include <gtest/gtest.h>

#include <string>

#include "moecore/util/json_string.h"

namespace moecore {
namespace {

TEST(UtilJsonString, EscapesAsPythonJsonDumps) {
  EXPECT_EQ(json_string("plain/path_1"), "\"plain/path_1\"");
  EXPECT_EQ(json_string("a\"b\\c"), "\"a\\\"b\\\\c\"");
  // json.dumps("\n\t\x01") == '"\\n\\t\\u0001"'
  EXPECT_EQ(json_string("\n\t\x01"), "\"\\n\\t\\u0001\"");
  // json.dumps("caf\u00e9 \U0001F600") == '"caf\\u00e9 \\ud83d\\ude00"'
  EXPECT_EQ(json_string("caf\xc3\xa9 \xf0\x9f\x98\x80"), "\"caf\\u00e9 \\ud83d\\ude00\"");
}

TEST(UtilJsonString, BytesThatAreNotUtf8BecomeTheReplacementCharacter) {
  EXPECT_EQ(json_string("a\xff"), "\"a\\ufffd\"");
}

}  // namespace
}  // namespace moecore
