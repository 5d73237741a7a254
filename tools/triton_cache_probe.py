"""Which Triton kernels a second process compiles again instead of loading from Triton's on-disk cache.

    python tools/triton_cache_probe.py [--path mxfp8] [--seq 4096]     # CUDA

Runs the block's first step (examples/mla_block.py's MLABlock at the DeepSeek-V3 shape, one forward +
backward) in two fresh processes that share one empty TRITON_CACHE_DIR, then lists the cache entries
the second process added: a kernel named there was not found under the key the first process wrote.
For each such kernel the metadata that differs from the first process's entry of the same name is
printed (the key's inputs that Triton writes into the entry's JSON), so the differing part of the key
can be read off.
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
import sys, torch
sys.path.insert(0, {root!r}); sys.path.insert(0, {examples!r})
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
# every JITFunction's source key (its own source, its callees', the constexpr globals): the part of
# Triton's cache key that the entry's metadata does not show
import json, importlib, pkgutil, backends.triton as bt
keys = {{}}
for info in pkgutil.iter_modules(bt.__path__):
    mod = importlib.import_module("backends.triton." + info.name)
    for name, obj in vars(mod).items():
        fn = obj
        while hasattr(fn, "fn") and not hasattr(fn, "cache_key"):
            fn = fn.fn
        if hasattr(fn, "cache_key") and getattr(fn, "__module__", "") == mod.__name__:
            keys[mod.__name__ + "." + name] = fn.cache_key
with open({keys_out!r}, "w") as fh:
    json.dump(keys, fh)
"""


def entries(cache: str) -> dict:
    """{entry dir: (kernel name, metadata dict)} of a Triton cache directory."""
    out = {}
    for d in sorted(os.listdir(cache)):
        full = os.path.join(cache, d)
        if not os.path.isdir(full):
            continue
        for f in os.listdir(full):
            if f.endswith(".json") and not f.startswith("__grp__"):
                try:
                    with open(os.path.join(full, f)) as fh:
                        meta = json.load(fh)
                except (OSError, ValueError):
                    meta = {}
                out[d] = (f[:-len(".json")], meta)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--path", default="mxfp8", choices=("mxfp8", "bf16"))
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--smoke", action="store_true", help="the small config on the CPU (checks the script only)")
    args = ap.parse_args()
    device, config, seq = ("cpu", "small", 32) if args.smoke else ("cuda", "deepseek", args.seq)
    with tempfile.TemporaryDirectory(prefix="mxmla_cache_probe_") as tmp:
        env = dict(os.environ, TRITON_CACHE_DIR=os.path.join(tmp, "triton"), MXMLA_CACHE_DIR=os.path.join(tmp, "mx"))
        seen, source_keys = {}, {}
        for run in ("first", "second"):
            keys_out = os.path.join(tmp, f"keys_{run}.json")
            code = CHILD.format(root=ROOT, examples=os.path.join(ROOT, "examples"), seq=seq, path=args.path,
                                device=device, config=config, keys_out=keys_out)
            t0 = time.perf_counter()
            proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
            wall = time.perf_counter() - t0
            if proc.returncode:
                sys.exit(f"{run} process failed:\n{proc.stderr[-2000:]}")
            now = entries(env["TRITON_CACHE_DIR"]) if os.path.isdir(env["TRITON_CACHE_DIR"]) else {}
            added = {d: v for d, v in now.items() if d not in seen}
            print(f"{run} process: {len(added)} cache entries added, {wall:.1f} s wall (start, import, one step)")
            with open(keys_out) as fh:
                source_keys[run] = json.load(fh)
            if run == "second":
                for d, (name, meta) in sorted(added.items(), key=lambda kv: kv[1][0]):
                    print(f"  compiled again: {name} ({d})")
                    for od, (oname, ometa) in seen.items():
                        if oname != name:
                            continue
                        diff = {k: (ometa.get(k), meta.get(k)) for k in set(ometa) | set(meta)
                                if ometa.get(k) != meta.get(k) and k != "hash"}
                        print(f"    vs {od}: {json.dumps(diff, default=str)[:600]}")
            seen = now
        differ = sorted(k for k in source_keys["first"] if source_keys["first"][k] != source_keys["second"].get(k))
        print(f"JIT functions whose source key differs between the processes: {len(differ)} of {len(source_keys['first'])}")
        for k in differ:
            print(f"  {k}")


if __name__ == "__main__":
    main()
