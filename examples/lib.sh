# Shared by the example scripts (source it). Reads the "#@ key=value" metadata of a config.
#   config_meta FILE KEY DEFAULT   prints the value of KEY in FILE, or DEFAULT
config_meta() {
  local value
  value=$(grep -h '^#@' "$1" | tr ' ' '\n' | sed -n "s/^$2=//p" | head -n 1)
  echo "${value:-$3}"
}

# config_flag FILE FLAG DEFAULT: the value after FLAG in an args file (its last occurrence, as
# Megatron's parser takes it; '#' starts a comment), or DEFAULT
config_flag() {
  local value
  value=$(sed 's/#.*//' "$1" | awk -v flag="$2" '{ for (i = 1; i < NF; i++) if ($i == flag) v = $(i + 1) } END { print v }')
  echo "${value:-$3}"
}

# dispatcher_flags NAME: the Megatron flags of a dispatcher choice
#   mok | alltoall | allgather | flex-deepep | flex-hybridep
dispatcher_flags() {
  case "$1" in
    mok) echo "--moe-token-dispatcher-type mok" ;;
    alltoall) echo "--moe-token-dispatcher-type alltoall" ;;
    allgather) echo "--moe-token-dispatcher-type allgather" ;;
    flex-deepep) echo "--moe-token-dispatcher-type flex --moe-flex-dispatcher-backend deepep" ;;
    flex-hybridep) echo "--moe-token-dispatcher-type flex --moe-flex-dispatcher-backend hybridep" ;;
    *) echo "unknown dispatcher '$1' (mok, alltoall, allgather, flex-deepep, flex-hybridep)" >&2; return 1 ;;
  esac
}
