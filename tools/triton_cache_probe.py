"""Which Triton kernels a later process compiles again instead of loading from Triton's on-disk cache,
and which part of Triton's cache key differed.

    python tools/triton_cache_probe.py [--path mxfp8] [--seq 4096] [--processes 4]     # CUDA
    python tools/triton_cache_probe.py --smoke                                         # CPU, script check

Runs the block's first step (examples/mla_block.py's MLABlock at the DeepSeek-V3 shape, one forward +
backward) in several fresh processes, one after another, sharing one empty TRITON_CACHE_DIR. Each
process records every cache key Triton's compile() computes (it wraps the compiler's get_cache_key):
the kernel, the thread, the key's hash (the cache entry's directory) and the key's parts -- the
JITFunction's source key (its source, its callees', the constexpr globals), the specialization
attributes, the signature, the constants, the backend's and the options' hashes, the environment.
A key of a later process that no earlier process computed is a compilation again; for each one the
parts that differ from the closest earlier key of the same kernel are printed. The probe also counts
the cache entries each process added.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHILD = r"""
import hashlib, json, sys, threading
sys.path.insert(0, {root!r}); sys.path.insert(0, {examples!r})
records = []
try:
    import triton.compiler.compiler as compiler
    real_key = compiler.get_cache_key

    def recorded_key(src, backend, options, env_vars):
        key = real_key(src, backend, options, env_vars)
        parts = {{}}
        try:
            fn = src.fn
            get = lambda v: v.cache_key if hasattr(v, "cache_key") else str(v)
            parts = dict(fn=fn.cache_key, attrs=str(src.attrs),
                         signature=str([v for _, v in sorted(src.signature.items())]),
                         constants="-".join(get(v) for _, v in sorted(src.constants.items())),
                         backend=backend.hash(), options=options.hash(), env=str(sorted(env_vars.items())))
            name = getattr(fn, "__name__", "?")
        except Exception as exc:  # another Triton layout: the hash alone
            name, parts = getattr(src, "name", "?"), dict(error=repr(exc))
        records.append(dict(name=name, thread=threading.current_thread().name,
                            hash=hashlib.sha256(key.encode("utf-8")).hexdigest(), parts=parts))
        return key

    compiler.get_cache_key = recorded_key
except ImportError:
    pass
import torch
import mla_block
dev = {device!r}
cfg = mla_block.replace(mla_block.CONFIGS[{config!r}], batch=1, seq={seq})
block = mla_block.MLABlock(cfg, {path!r}).reset_parameters(0).to(dev)
h = torch.randn(cfg.tokens, cfg.hidden).to(torch.bfloat16).to(dev).requires_grad_(True)
cos, sin = mla_block.rope_tables(cfg, dev)
block(h, cos, sin).float().square().mean().backward()
if dev == "cuda":
    torch.cuda.synchronize()
    from backends.triton import wait_background_compiles
    wait_background_compiles()
with open({records_out!r}, "w") as fh:
    json.dump(records, fh)
"""


def entries(cache: str) -> set:
    """Names of the cache entry directories of a Triton cache directory."""
    if not os.path.isdir(cache):
        return set()
    return {d for d in os.listdir(cache) if os.path.isdir(os.path.join(cache, d))}


def differing_parts(rec: dict, earlier: list) -> dict:
    """The parts of rec's key that differ from the earlier key of the same kernel sharing most parts."""
    same = [e for e in earlier if e["name"] == rec["name"]]
    if not same:
        return {"(no earlier key of this kernel)": (None, None)}
    best = max(same, key=lambda e: sum(e["parts"].get(k) == v for k, v in rec["parts"].items()))
    return {k: (best["parts"].get(k), v) for k, v in rec["parts"].items() if best["parts"].get(k) != v}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--path", default="mxfp8", choices=("mxfp8", "bf16"))
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--processes", type=int, default=4)
    ap.add_argument("--smoke", action="store_true", help="the small config on the CPU (checks the script only)")
    args = ap.parse_args()
    device, config, seq = ("cpu", "small", 32) if args.smoke else ("cuda", "deepseek", args.seq)
    with tempfile.TemporaryDirectory(prefix="mxmla_cache_probe_") as tmp:
        env = dict(os.environ, TRITON_CACHE_DIR=os.path.join(tmp, "triton"), MXMLA_CACHE_DIR=os.path.join(tmp, "mx"))
        seen_entries, earlier = set(), []
        for run in range(args.processes):
            records_out = os.path.join(tmp, f"records_{run}.json")
            code = CHILD.format(root=ROOT, examples=os.path.join(ROOT, "examples"), seq=seq, path=args.path,
                                device=device, config=config, records_out=records_out)
            t0 = time.perf_counter()
            proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
            wall = time.perf_counter() - t0
            if proc.returncode:
                sys.exit(f"process {run} failed:\n{proc.stderr[-2000:]}")
            now = entries(env["TRITON_CACHE_DIR"])
            with open(records_out) as fh:
                records = json.load(fh)
            known = {e["hash"] for e in earlier}
            new = [r for r in records if r["hash"] not in known]
            print(f"process {run}: {wall:.1f} s wall (start, import, one step); {len(records)} cache keys computed, "
                  f"{len(new)} not computed by an earlier process; {len(now - seen_entries)} cache entries added")
            if run:
                for r in new:
                    print(f"  new key: {r['name']} ({r['hash'][:16]}, thread {r['thread']})")
                    for part, (before, after) in differing_parts(r, earlier).items():
                        print(f"    {part}: {str(before)[:300]!s}  ->  {str(after)[:300]!s}")
            seen_entries |= now
            earlier += records


if __name__ == "__main__":
    main()
