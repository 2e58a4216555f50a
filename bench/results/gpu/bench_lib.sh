# Sourced by the run_*.sh scripts here: the ~1.4B GPT (24 layers, hidden 2048, 16 heads, ffn
# 5632, vocab 32000, seq 2048; 1.364B params) and the wrapper that keeps a run's evidence.
MODEL_1B="--set model.num_layers=24 --set model.hidden_size=2048 --set model.num_heads=16
 --set model.ffn_hidden_size=5632 --set model.vocab_size=32000 --set model.max_seq_len=2048
 --set train.seq_len=2048 --set train.lr=0.0001"

# keep_run NAME DEST TIMEOUT_S LINES CMD: runs CMD (a word-split string) under `timeout`, writes
# DEST/NAME.cmd and DEST/NAME.log, prints the last LINES log lines without warnings, then its exit status.
keep_run() {
  local name=$1 dest=$2 timeout_s=$3 lines=$4 cmd=$5
  mkdir -p "$dest"
  echo $cmd > "$dest/$name.cmd"
  PYTHONUNBUFFERED=1 timeout -k 20 "$timeout_s" $cmd 2>&1 | tee "$dest/$name.log" | grep -vE "Warning|warn|socket.cpp" | tail -"$lines"
  echo "== $name exit ${PIPESTATUS[0]}"
}

# device_kind: the device tool's name of this machine's kind (nvidia-h200, nvidia-h200-x2,
# nvidia-h100-x1, nvidia-h100-x2, ...) from nvidia-smi, for the names of the kept files.
device_kind() {
  local n gpu
  n=$(nvidia-smi -L | wc -l)
  case "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)" in *H200*) gpu=h200 ;; *) gpu=h100 ;; esac
  if [ "$gpu" = h200 ] && [ "$n" -eq 1 ]; then echo nvidia-h200; else echo "nvidia-$gpu-x$n"; fi
}
