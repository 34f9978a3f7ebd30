import sys, torch
from flashtriton.kernels import backward_gluon_launch as BL
from flashtriton import configs
causal = sys.argv[1] == "1"; D = int(sys.argv[2]); stages = int(sys.argv[3]); out = sys.argv[4]
cfg = configs.backward.gluon_bwd_config(D, 4096, 4096, causal)
cfg = dict(cfg["dkdv"], NUM_STAGES=stages)
print(cfg)
k = BL.compile_for_sm90(D, causal, cfg, torch.bfloat16, kernel="dkdv")
open(out, "wb").write(k.asm["cubin"])
print("shared", k.metadata.shared)
