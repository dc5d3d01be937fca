#!/usr/bin/env bash
# lint.layers: a source file under src/moecore/<folder>/ includes moecore/<other>/... only where <other> is its own
# folder, a folder of the same library (model/ and moe/ are moecore_model), or a layer its library links, directly or
# through others. The layer graph is read from one place, the moecore_layer(NAME DIRS DEPS...) and
# target_link_libraries(NAME ... DEPS...) calls of the top CMakeLists.txt, so it follows every change there.
# apps/ may include anything. Usage: layers.sh [SOURCE_DIR]; prints one `error:` line per upward include.
set -euo pipefail
root=${1:-$(cd "$(dirname "$0")/../.." && pwd)}
cmake_file="$root/CMakeLists.txt"

declare -A library_of_folder  # folder under src/moecore/ -> its library
declare -A links              # library -> the moecore_* libraries it links directly (space separated)
# The calls, comments dropped and each call's words on one line (a call may span lines).
calls=$(sed 's/#.*//' "$cmake_file" | tr '\n' ' ' | grep -oE '\b(moecore_layer|target_link_libraries)\([^)]*\)' || true)
[ -n "$calls" ] || { echo "error: $cmake_file: no moecore_layer(...) call"; exit 1; }
while read -r call; do
  words=$(sed -E 's/^[a-z_]+\(//; s/\)$//; s/"//g' <<<"$call")
  read -r -a word <<<"$words"
  library=${word[0]}
  [[ $library == moecore_* ]] || continue
  if [[ $call == moecore_layer* ]]; then
    IFS=';' read -r -a folders <<<"${word[1]}"
    for folder in "${folders[@]}"; do library_of_folder[$folder]=$library; done
  fi
  for dep in "${word[@]:1}"; do
    if [[ $dep == moecore_* ]]; then links[$library]="${links[$library]:-} $dep"; fi
  done
done <<<"$calls"

# reaches A B: does library A link library B, directly or through others?
declare -A reached
reaches() {
  local key="$1>$2"
  if [ -z "${reached[$key]:-}" ]; then
    reached[$key]=no
    local dep
    for dep in ${links[$1]:-}; do
      if [ "$dep" = "$2" ] || reaches "$dep" "$2"; then reached[$key]=yes; break; fi
    done
  fi
  [ "${reached[$key]}" = yes ]
}

errors=0
for dir in "$root"/src/moecore/*/; do
  folder=$(basename "$dir")
  if [ -z "${library_of_folder[$folder]:-}" ]; then
    echo "error: src/moecore/$folder/ belongs to no moecore_layer(...) of CMakeLists.txt"
    errors=$((errors + 1))
  fi
done
while IFS=: read -r file line text; do
  rel=${file#"$root"/}
  folder=${rel#src/moecore/}
  folder=${folder%%/*}
  [[ $text =~ [\<\"](moecore/([^/\">]+)/[^\">]*) ]] || continue
  included=${BASH_REMATCH[1]}
  other=${BASH_REMATCH[2]}
  [ "$other" = "$folder" ] && continue
  library=${library_of_folder[$folder]:-}
  other_library=${library_of_folder[$other]:-}
  [ -n "$library" ] || continue  # reported above
  if [ -z "$other_library" ]; then
    echo "error: $rel:$line includes \"$included\": moecore/$other/ is no layer of CMakeLists.txt"
    errors=$((errors + 1))
  elif [ "$other_library" != "$library" ] && ! reaches "$library" "$other_library"; then
    echo "error: $rel:$line includes \"$included\": $library ($folder/) does not link $other_library ($other/)"
    errors=$((errors + 1))
  fi
done < <(grep -rnE '^[[:space:]]*#[[:space:]]*include[[:space:]]*[<"]moecore/[^/">]+/' "$root/src/moecore" \
           --include='*.h' --include='*.cpp' --include='*.hpp' --include='*.cc' | sort)

if [ "$errors" -ne 0 ]; then
  echo "lint.layers: $errors include(s) against the layer order of CMakeLists.txt"
  exit 1
fi
echo "lint.layers: every include of src/moecore follows the layer order of CMakeLists.txt (${#library_of_folder[@]} folders)"
