# Sourced by the shell tests: the flags of a named recipe, configs/NAME.args (one flag and its value per line, #
# comments), one word per line, for `mapfile -t ARRAY < <(recipe "$src" NAME)`.
recipe() {  # recipe SOURCE_DIR NAME
  local flag value
  while read -r flag value; do
    printf '%s\n' "$flag"
    if [ -n "$value" ]; then printf '%s\n' "$value"; fi
  done < <(grep -v '^#' "$1/configs/$2.args" | grep -v '^\s*$')
}
