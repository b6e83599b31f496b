# Sourced by the GPU scripts (gpu-run.sh through gpu-bins.sh, gpu-doors.sh, ctests/nccl/gpu.sh)
# from the repository root: several rank processes sharing one GPU, the one way they all do it.
#   $SMS             the SM count of GPU 0 (scripts/sm-count.sh; SMS=N overrides)
#   max_ctas_for N   the MK_MAX_CTAS of each of N ranks sharing the GPU (empty for one rank)
#   rank_env N       the environment of one of N rank processes: MK_TEST_NRANKS=N and, for
#                    N > 1, an MPS client's 100/N % of the SMs and a grid cap of max_ctas_for N
#                    (NAME=VALUE words, for `env $(rank_env N) CMD` where CMD is not a function)
#   as_ranks N CMD   runs CMD (a program, not a shell function) in that environment
#   mps_start NAME   starts an MPS control daemon (pipe and log folders /tmp/mk-NAME-mps*);
#                    $MPS is 1 while one this shell started runs. Ranks time-slice without it.
#   mps_stop         stops it (a no-op when none runs); the caller's EXIT trap should call it
SMS=${SMS:-$(scripts/sm-count.sh)}
# Under MPS each of N ranks gets CUDA_MPS_ACTIVE_THREAD_PERCENTAGE = 100/N % of the SMs; its
# grid cap is half of that share, of the SM count rounded down to a multiple of 8, so every
# persistent grid stays co-resident (132 SMs: 32, 16 and 8 at 2, 4 and 8 ranks, at least 1).
max_ctas_for() {
  local n=$1 cap
  [ "$n" -gt 1 ] || { echo ""; return; }
  cap=$(( SMS / 8 * 8 / n / 2 ))
  echo $(( cap > 0 ? cap : 1 ))
}
rank_env() {
  if [ "$1" -gt 1 ]; then
    echo "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=$(( 100 / $1 )) MK_MAX_CTAS=$(max_ctas_for "$1") MK_TEST_NRANKS=$1"
  else
    echo "MK_TEST_NRANKS=1"
  fi
}
as_ranks() {
  local n=$1; shift
  # shellcheck disable=SC2046  # rank_env's words are NAME=VALUE pairs without spaces
  env $(rank_env "$n") "$@"
}
MPS=0
mps_start() {
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/mk-$1-mps CUDA_MPS_LOG_DIRECTORY=/tmp/mk-$1-mpslog
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  [ "$MPS" = 1 ] && return 0
  if nvidia-cuda-mps-control -d 2>/dev/null; then MPS=1; else return 1; fi
}
mps_stop() {
  if [ "$MPS" = 1 ]; then echo quit | timeout 20 nvidia-cuda-mps-control; MPS=0; fi
}
