source .gpu/install.sh .gpu >/dev/null 2>&1
N=nvidia-h200_2026-12-01
v() { name=$1; shift; mkdir -p /tmp/$name; timeout 150 python3 - "$@" > $OUT/$name.log 2>&1 <<'PY'
import sys
args = sys.argv[1:]
if args and args[0] == "--swiglu-fusion":
    args = args[1:]
    import megatron.core.transformer as T
    orig = T.TransformerConfig
    T.TransformerConfig = lambda **kw: orig(**{**kw, "bias_activation_fusion": True})
sys.argv = ["profile_step", *args]
from bench.profile_step import main
main()
PY
echo "$name rc $?"; grep -E "per profiled step|shares:|host syncs" $OUT/$name.log; cp /tmp/$name/*.json $OUT/$name.json 2>/dev/null; }
v prof_mb4_syncfix_$N --micro-batch 4 --out-dir /tmp/prof_mb4_syncfix_$N
v prof_mb4_swiglu_$N --swiglu-fusion --micro-batch 4 --out-dir /tmp/prof_mb4_swiglu_$N
v prof_mb8_syncfix_$N --micro-batch 8 --out-dir /tmp/prof_mb8_syncfix_$N
