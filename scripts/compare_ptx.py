"""Compile the attention kernels (Triton and Gluon) offline for sm_90 (no GPU needed) and write their PTX, so that a refactor
can be shown to leave the generated code unchanged:

    python scripts/compare_ptx.py /tmp/before      # on the old commit
    python scripts/compare_ptx.py /tmp/after       # on the new one
    diff -r /tmp/before /tmp/after                 # debug-info labels are already stripped

Pointers are marked 16-byte aligned and the head-dim strides 1, as a real launch specialises them.
"""

import re
import sys
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from flashtriton.kernels import backward, forward

TENSORS = {"Q", "K", "V", "O", "DO", "DQ", "DK", "DV"}
DQ_FUSED_ARGS = ("O", "DLSE", "SINK", "SINK_PART", "stride_ob", "stride_om", "stride_oh", "stride_od", "stride_db",
                 "stride_dh", "stride_dm")
UNALIGNED_INTS = {"NUM_HEADS", "NUM_HEADS_KV", "GROUP_SIZE"}


def signature(fn, constexprs):
    sig = {}
    for name in fn.arg_names:
        if name.startswith("stride_") and name.endswith("d"):
            constexprs[name] = 1
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in TENSORS:
            sig[name] = "*fp16"
        elif name in ("LSE", "DELTA"):
            sig[name] = "*fp32"
        elif name.startswith("CU_SEQLENS"):
            sig[name] = "*i32"
        elif name in ("softmax_scale", "qk_scale"):
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
             if sig[n].startswith("*") or (sig[n] == "i32" and n not in UNALIGNED_INTS)}
    return sig, attrs


def code_only(ptx: str) -> str:
    """The instructions: debug sections, labels and source positions (.loc / .file, which move with any edit
    of the file) dropped."""
    ptx = ptx.split(".section")[0]
    return "\n".join(line for line in ptx.splitlines()
                     if line.strip() and not re.match(r"^(\$L__tmp\d+:|\s*\.(loc|file)\b)", line))


def main(out_dir: str) -> None:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    kernels = [(forward._attn_fwd, "fwd", (128, 64, 8, 3)), (backward._attn_bwd_dq, "dq", (128, 32, 8, 2)),
               (backward._attn_bwd_dkdv, "dkdv", (32, 128, 8, 2))]
    # (head dim, V's head dim, causal, varlen); V's head dim of its own (DeepSeek's MLA) last
    cases = [(64, 64, True, False), (128, 128, False, False), (128, 128, True, True), (80, 80, True, False),
             (192, 128, True, False)]
    for head_dim, head_dim_v, causal, varlen in cases:
        for fn, name, (block_m, block_n, warps, stages) in kernels:
            constexprs = dict(HEAD_DIM=head_dim, BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
                              IS_CAUSAL=causal, CAUSAL_BOTTOM_RIGHT=True, IS_VARLEN=varlen, UPCAST_DOT=False,
                              DOT_PRECISION="tf32", BLOCK_M=block_m, BLOCK_N=block_n)
            if "HEAD_DIM_V" in fn.arg_names:
                constexprs.update(HEAD_DIM_V=head_dim_v, BLOCK_DV=max(16, triton.next_power_of_2(head_dim_v)))
            elif head_dim_v != head_dim:
                continue
            # no window, softcap, dropout, pages or accumulation: the flags off, their scalars None (the launchers')
            constexprs.update({n: v for n, v in dict(HAS_WINDOW=False, HAS_SOFTCAP=False, HAS_ALIBI=False,
                                                     HAS_SINKS=False, HAS_DROPOUT=False, window_left=None,
                                                     window_right=None, softcap=None, ALIBI=None, stride_alibi_b=None,
                                                     SINKS=None, DROPOUT_RNG=None, dropout_threshold=None,
                                                     dropout_scale=None, BLOCK_TABLE=None, stride_btb=None,
                                                     capacity=None, num_pages=None, SEQUSED_K=None, PAGED=False,
                                                     PAGE_SIZE=1, HAS_SEQUSED_K=False, ACCUMULATE=False).items()
                               if n in fn.arg_names})
            if name == "dq":  # the preprocess' work elsewhere (`backward._attn_bwd_dq`'s FUSED off: its arguments None)
                constexprs.update(dict.fromkeys(DQ_FUSED_ARGS), FUSED=0)
            sig, attrs = signature(fn, constexprs)
            compiled = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs),
                                      target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=stages))
            dv = "" if head_dim_v == head_dim else f"_dv{head_dim_v}"
            path = out / f"{name}_d{head_dim}{dv}_causal{int(causal)}_varlen{int(varlen)}.ptx"
            path.write_text(code_only(compiled.asm["ptx"]))
            print(path)
    paged_kernels(out)
    tma_kernels(out)
    decode_kernels(out)
    gluon_kernels(out)
    gluon_bwd_kernels(out)


def paged_kernels(out: Path) -> None:
    """The portable forward over paged K/V (varlen, causal, D=128): pages of 16 keys (each key row's page looked
    up) and 128 (one page per tile), with seqused_k."""
    fn = forward._attn_fwd
    for page_size, seqused in ((16, False), (128, True)):
        constexprs = dict(HEAD_DIM=128, BLOCK_D=128, HEAD_DIM_V=128, BLOCK_DV=128, IS_CAUSAL=True,
                          CAUSAL_BOTTOM_RIGHT=True, IS_VARLEN=True, UPCAST_DOT=False, DOT_PRECISION="tf32",
                          BLOCK_M=128, BLOCK_N=64, HAS_WINDOW=False, HAS_SOFTCAP=False, HAS_ALIBI=False,
                          HAS_SINKS=False, HAS_DROPOUT=False, PAGED=True, PAGE_SIZE=page_size,
                          HAS_SEQUSED_K=seqused)
        constexprs.update({n: None for n in ("window_left", "window_right", "softcap", "ALIBI", "stride_alibi_b",
                                             "SINKS", "DROPOUT_RNG", "dropout_threshold", "dropout_scale")})
        if not seqused:
            constexprs["SEQUSED_K"] = None
        sig, attrs = signature(fn, constexprs)
        sig.update({n: "*i32" for n in ("BLOCK_TABLE", "SEQUSED_K") if sig[n] != "constexpr"})
        compiled = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs),
                                  target=GPUTarget("cuda", 90, 32), options=dict(num_warps=8, num_stages=3))
        path = out / f"fwd_paged{page_size}_seqused{int(seqused)}_d128_causal1.ptx"
        path.write_text(code_only(compiled.asm["ptx"]))
        print(path)


def gluon_bwd_kernels(out: Path) -> None:
    """The Gluon backward (dK/dV and dQ) in every config the dispatch picks, dense and varlen, causal or not."""
    from flashtriton import configs
    from flashtriton.kernels.backward_gluon_launch import compile_for_sm90

    for head_dim in (64, 128):
        for causal in (False, True):
            for varlen in (False, True):
                config = configs.gluon_bwd_config(head_dim, 4096, 4096, causal)
                for kernel in ("dkdv", "dq"):
                    compiled = compile_for_sm90(head_dim, causal, config[kernel], kernel=kernel, varlen=varlen)
                    path = out / f"bwd_gluon_{kernel}_d{head_dim}_causal{int(causal)}_varlen{int(varlen)}.ptx"
                    path.write_text(code_only(compiled.asm["ptx"]))
                    print(path)


def gluon_kernels(out: Path) -> None:
    """The Gluon forward in every config the dispatch picks: dense D=128 (long and short keys, causal or not),
    D=64 non-causal (three consumers), varlen D=128 (dynamic schedule), causal or not."""
    from flashtriton import configs
    from flashtriton.kernels.forward_gluon_launch import compile_for_sm90

    cases = [(d, t, c, False) for d, t, c in ((128, 16384, False), (128, 16384, True), (128, 1024, False),
                                              (128, 1024, True), (64, 16384, False))]
    cases += [(128, 4096, True, True), (128, 4096, False, True)]
    for head_dim, keys, causal, varlen in cases:
        pick = configs.gluon_varlen_config if varlen else configs.gluon_fwd_config
        compiled = compile_for_sm90(head_dim, causal, pick(head_dim, keys, keys, causal), varlen=varlen)
        path = out / f"fwd_gluon_d{head_dim}_k{keys}_causal{int(causal)}_varlen{int(varlen)}.ptx"
        path.write_text(code_only(compiled.asm["ptx"]))
        print(path)


def tma_kernels(out: Path) -> None:
    """The Hopper TMA forward, with tensor-descriptor arguments, dense and varlen, at two tile shapes."""
    fn = forward._attn_fwd_tma
    for causal, varlen in ((False, False), (True, False), (True, True)):
        for block_m, block_n, warps, stages in ((64, 32, 4, 3), (128, 128, 8, 3)):
            constexprs = dict(HEAD_DIM=128, IS_CAUSAL=causal, CAUSAL_BOTTOM_RIGHT=True, IS_VARLEN=varlen,
                              BLOCK_M=block_m, BLOCK_N=block_n, UPCAST_DOT=False)
            constexprs.update({n: None for n in ("window_left", "window_right", "softcap", "ALIBI", "stride_alibi_b",
                                                 "SINKS") if n in fn.arg_names})
            constexprs.update({n: False for n in ("HAS_WINDOW", "HAS_SOFTCAP", "HAS_ALIBI", "HAS_SINKS")
                               if n in fn.arg_names})
            if "WARP_SPECIALIZE" in fn.arg_names:
                constexprs["WARP_SPECIALIZE"] = False

            def desc(rows):
                return f"tensordesc<fp16[{rows},1,128]>" if varlen else f"tensordesc<fp16[1,{rows},1,128]>"

            sig = {"desc_q": desc(block_m), "desc_k": desc(block_n), "desc_v": desc(block_n), "desc_o": desc(block_m),
                   "O": "*fp16", "LSE": "*fp32", "CU_SEQLENS_Q": "*i32", "CU_SEQLENS_K": "*i32", "qk_scale": "fp32"}
            for name in fn.arg_names:
                sig.setdefault(name, "constexpr" if name in constexprs else "i32")
            attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
                     if n in ("O", "LSE", "CU_SEQLENS_Q", "CU_SEQLENS_K", "stride_om", "stride_oh", "stride_lb",
                              "stride_lh", "SEQLEN_Q", "SEQLEN_K")}
            compiled = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs),
                                      target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=stages))
            path = out / f"fwd_tma_causal{int(causal)}_varlen{int(varlen)}_{block_m}x{block_n}.ptx"
            path.write_text(code_only(compiled.asm["ptx"]))
            print(path)


def decode_kernels(out: Path) -> None:
    """The decode kernels as a launch builds them (`decode_launch.compile_for_sm90`: the plan's constexprs and
    options): the split-KV kernel, contiguous and paged, one split and several, causal or not; the stream-schedule
    kernel, contiguous and paged."""
    from flashtriton.kernels import decode_launch
    from flashtriton.kernels.variant import Variant

    cases = [(False, True, 0, False), (True, True, 0, True),  # (paged, stream, splits, causal)
             (False, False, 1, False), (False, False, 4, True), (True, False, 4, False)]
    for paged, stream, splits, causal in cases:
        compiled = decode_launch.compile_for_sm90(Variant.of(causal, True), paged=paged, stream=stream,
                                                  num_splits=splits or 2)
        name = (f"decode_stream_paged{int(paged)}_causal{int(causal)}.ptx" if stream
                else f"decode_paged{int(paged)}_split{int(splits > 1)}_causal{int(causal)}.ptx")
        path = out / name
        path.write_text(code_only(compiled.asm["ptx"]))
        print(path)


if __name__ == "__main__":
    main(sys.argv[1])
