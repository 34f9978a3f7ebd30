"""Checking then timing one provider on one problem, every mode: what the standard, varlen / decode and variants
suites share (`bench.py` runs the standard sweep, `bench_suites.py` the serving ones, `bench_variants.py` the
variants, which check every provider of a problem first and then time them in interleaved rounds)."""

from __future__ import annotations

import contextlib
import statistics
import sys
import time

import torch

from . import bench_core as C
from . import bench_providers as P


# ----------------------------------------------------------------------------------------------------------
def measure(prepared: P.Prepared, modes, ref, to_ref, make_dout, dtype, args) -> tuple[dict, dict]:
    """Check `prepared` against `ref`, then time each mode that passed.

    ref: {"out", "dq", "dk", "dv"} reference tensors (None: no check possible); to_ref maps the provider's
    {"out", "dq", "dk", "dv"} (its layout) onto ref's slices; make_dout(out) builds the output gradient in
    the provider's layout with out's strides. Returns ({mode: row fields}, extra fields).
    """
    results, extra = check(prepared, modes, ref, to_ref, make_dout, dtype, args)
    for mode, fields in results.items():
        if fields["status"] != "ok":
            continue
        try:
            fields["ms_p20"], fields["ms_p50"], fields["ms_p80"] = time_mode(prepared, mode, make_dout, args)
        except Exception as exc:  # noqa: BLE001
            fields.update(status="error", error=C.short_error(exc))
        finally:
            for t in prepared.leaves:
                t.grad = None
            C.free_memory()
    return results, extra


def check(prepared: P.Prepared, modes, ref, to_ref, make_dout, dtype, args) -> tuple[dict, dict]:
    """`measure`'s check alone: run `prepared` forward (and, for bwd / fwd_bwd, backward) once and compare with
    `ref`. Returns ({mode: row fields with status ok, error or check_failed}, extra fields); nothing is timed."""
    # the timing method goes with every row: readings taken with different warmups differ (`--warmup`)
    extra, fwd_err, bwd_err, fwd_chk, bwd_chk = dict(warmup_ms=args.warmup, rep_ms=args.rep), None, None, None, None
    leaves = prepared.leaves
    try:
        start = time.perf_counter()
        with torch.no_grad():
            out = prepared.forward()
        C.free_memory()
        extra["first_call_s"] = round(time.perf_counter() - start, 3)
        if ref is not None:
            fwd_chk = C.compare(to_ref({"out": out}), {"out": ref["out"]}, dtype)
        del out
    except Exception as exc:  # noqa: BLE001  (reported in the row; the run goes on)
        fwd_err = C.short_error(exc)
        C.free_memory()
    if fwd_err is None and any(m != "fwd" for m in modes):
        try:
            out = prepared.forward()
            out.backward(make_dout(out))
            got = {"out": out.detach(), "dq": leaves[0].grad, "dk": leaves[1].grad, "dv": leaves[2].grad}
            if ref is not None:
                bwd_chk = C.compare(to_ref(got), ref, dtype)
            del out, got
        except Exception as exc:  # noqa: BLE001
            bwd_err = C.short_error(exc)
        finally:
            for t in leaves:
                t.grad = None
            C.free_memory()
    results = {}
    for mode in modes:
        error = fwd_err or (bwd_err if mode != "fwd" else None)
        chk = fwd_chk if mode == "fwd" else bwd_chk
        fields = dict(status="ok", error=error)
        if chk is not None:
            fields.update(check_passed=bool(chk[0]), max_err=chk[1], rel_err=chk[2])
        if error:
            fields["status"] = "error"
        elif chk is not None and not chk[0]:
            fields["status"] = "check_failed"
        results[mode] = fields
    return results, extra


def time_mode(prepared: P.Prepared, mode: str, make_dout, args):
    if mode == "fwd":
        with torch.no_grad():
            return C.time_fn(prepared.forward, args.warmup, args.rep)
    out = prepared.forward()
    dout = make_dout(out)
    if mode == "bwd":  # backward alone: the graph is kept and re-run; grads set to None between runs
        return C.time_fn(lambda: out.backward(dout, retain_graph=True), args.warmup, args.rep,
                         grad_to_none=prepared.leaves)
    del out
    return C.time_fn(lambda: prepared.forward().backward(dout), args.warmup, args.rep, grad_to_none=prepared.leaves)


def time_rounds(entries, args, rounds: int) -> dict:
    """Time every (entry, mode) of one problem in `rounds` rounds, each round starting at a different entry (spread
    over the list), so that the moment of extra speed a GPU has after a pause goes to a different provider each time
    (docs/performance.md's method).

    entries: {key: (prepared, modes, make_dout)}, make_dout as in `measure`. Each timing is `time_mode` (do_bench
    after its --warmup), inside the provider's context. Returns {(key, mode): fields}: ms_p20 / p50 / p80 the
    median over rounds of each round's reading, extra["round_ms"] the rounds' medians; or status error.
    """
    keys = list(entries)
    readings: dict = {}
    errors: dict = {}
    for r in range(max(1, rounds)):
        start = (r * len(keys)) // max(1, rounds) % len(keys) if keys else 0
        for key in keys[start:] + keys[:start]:
            prepared, modes, make_dout = entries[key]
            with prepared.context():
                for mode in modes:
                    if (key, mode) in errors:
                        continue
                    try:
                        readings.setdefault((key, mode), []).append(time_mode(prepared, mode, make_dout, args))
                    except Exception as exc:  # noqa: BLE001  (reported in the row; the others go on)
                        errors[(key, mode)] = C.short_error(exc)
                    finally:
                        for t in prepared.leaves:
                            t.grad = None
                        C.free_memory()
    out = {}
    for key in keys:
        for mode in entries[key][1]:
            if (key, mode) in errors:
                out[(key, mode)] = dict(status="error", error=errors[(key, mode)])
                continue
            got = readings[(key, mode)]
            out[(key, mode)] = dict(
                ms_p20=statistics.median(g[0] for g in got), ms_p50=statistics.median(g[1] for g in got),
                ms_p80=statistics.median(g[2] for g in got), extra={"round_ms": [round(g[1], 5) for g in got]})
    return out


@contextlib.contextmanager
def _interpreted_launches(names: list):
    """Record the name of every kernel Triton's interpreter launches (it has no device to profile)."""
    from triton.runtime.interpreter import InterpretedFunction

    run = InterpretedFunction.run

    def recording(self, *args, **kwargs):
        names.append(self.fn.__name__)
        return run(self, *args, **kwargs)

    InterpretedFunction.run = recording
    try:
        yield
    finally:
        InterpretedFunction.run = run


def launched_kernels(fn) -> list[str] | None:
    """The names of the kernels `fn()` launches, in order of first launch: on a GPU the device kernels torch's
    profiler sees (torch's own elementwise kernels left out), under Triton's interpreter the kernels it runs.
    None when the profiler saw no device kernel at all (it cannot tell)."""
    names: list[str] = []
    if torch.cuda.is_available():
        from torch.profiler import ProfilerActivity, profile

        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        device = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        if not device:
            return None
        names = [n for n in device if "at::native" not in n and not n.startswith(("void at::", "Memcpy", "Memset"))]
    else:
        with _interpreted_launches(names):
            fn()
    return list(dict.fromkeys(n[:120] for n in names))


def measure_rows(name, modes, skip_for, prepare_fn, ref, to_ref, make_dout, dtype, flops_for, env, base, args):
    """Rows of one provider on one problem: skipped modes, errors, failed checks and timings.

    skip_for(mode) -> reason or None; prepare_fn(grad) -> Prepared; to_ref(prepared, got) and
    make_dout(prepared) -> (out -> dout) adapt `measure`'s callbacks to the provider; flops_for(mode).
    """
    base = dict(base)
    base_extra = base.pop("extra", None) or {}
    rows, run_modes = [], []
    for mode in modes:
        reason = skip_for(mode)
        if reason:
            rows.append(C.make_row(env, **base, mode=mode, provider=name, status="skipped", error=reason,
                                   extra=dict(base_extra)))
        else:
            run_modes.append(mode)
    if not run_modes:
        return rows
    try:
        prepared = prepare_fn(any(m != "fwd" for m in run_modes))
    except Exception as exc:  # noqa: BLE001
        C.free_memory()
        return rows + [C.make_row(env, **base, mode=m, provider=name, status="error", error=C.short_error(exc),
                                  extra=dict(base_extra)) for m in run_modes]
    with prepared.context():
        results, extra = measure(prepared, run_modes, ref, lambda got: to_ref(prepared, got), make_dout(prepared),
                                 dtype, args)
    del prepared
    C.free_memory()
    for mode in run_modes:
        fields = results[mode]
        fields["tflops"] = C.tflops(flops_for(mode), fields.get("ms_p50"))
        rows.append(C.make_row(env, **base, mode=mode, provider=name, **fields, extra={**base_extra, **extra}))
    return rows


def emit(sink, rows) -> list[dict]:
    """Hand new rows to the run's Results (which writes them out at once), return them."""
    if sink is not None:
        sink.add(rows)
    return rows


def report_problems(rows, bar=None) -> None:
    for row in rows:
        if row["status"] in ("error", "check_failed"):
            what = row["error"] if row["status"] == "error" else f"check failed, max err {row['max_err']:.3g}"
            msg = (f"  {row['provider']} {row['mode']} {row['dtype']} B={row['B']} H={row['H']} T={row['T']} "
                   f"D={C.head_dim_label(row['D'], row.get('Dv'))} causal={row['causal']}: {what}")
            if bar is not None:
                bar.write(msg)
            else:
                print(msg, file=sys.stderr)
