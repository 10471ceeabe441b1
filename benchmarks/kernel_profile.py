"""Per-kernel profile of one compiled network of ``benchmarks/latency.py`` (the MLP, LeNet-5, ResNet-8 or
ResNet-20; the ResNets with an untrained He-scale posterior, random 3×32×32 inputs), summed per PFP op:
where the time of one ``exe(x)`` call goes, for either correlation scheme and any batch size.

    PYTHONPATH=. .venv/bin/python benchmarks/kernel_profile.py --net resnet20 --batch 1 [--threads 1]
        [--correlation auto|mean-field|shared-factor] [--static] [--method isolated|in_vm] [--kernels]

``--static``: profile the static-shape executable of ``net.compile(batch_sizes=[batch])``.  Kernels are
timed alone (``method="isolated"``, :func:`pyro2pfp.runtime.profiling.profile`), so the ``(vm overhead)`` row --
total minus the kernels -- also holds what running them in sequence costs on top (colder caches).
Use ``--threads 1`` on a shared machine: the numbers then move less with the load.
"""
from __future__ import annotations

import argparse
import collections
import os
import sys
import time
import warnings


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--net", default="resnet20", choices=["mlp", "lenet", "resnet8", "resnet20"])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--correlation", default="auto", choices=["auto", "mean-field", "shared-factor", "compact-factor"])
    ap.add_argument("--static", action="store_true", help="the static-shape executable of the batch size")
    ap.add_argument("--method", default="isolated", choices=["isolated", "in_vm"])
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--kernels", action="store_true", help="also print every kernel's row")
    args = ap.parse_args(argv)
    os.environ["TVM_NUM_THREADS"] = str(args.threads)
    os.environ.setdefault("TVM_BIND_THREADS", "0")
    warnings.simplefilter("ignore", UserWarning)
    import torch

    import pyro2pfp
    from pyro2pfp.backends.tvm.kernel_work import kernel_multiply_adds
    from pyro2pfp.runtime.profiling import profile

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import latency

    torch.set_num_threads(args.threads)
    model, guide, _, shape, x = latency.model_with_inputs(args.net, args.batch)
    net = pyro2pfp.convert(model, guide, input_shape=shape, correlation=args.correlation, check=False)
    t0 = time.process_time()
    exe = net.compile(batch_sizes=[args.batch] if args.static else ())
    compile_s = time.process_time() - t0
    # the predictor itself: profile() runs the static executable for a batch it was built for, and names
    # each kernel's op and layer from the predictor's kernel table (a raw VM has only the symbols)
    prof = profile(exe, [x], repeats=args.repeats, method=args.method, work=kernel_multiply_adds(net, args.batch))
    assert prof.batch == args.batch and (not args.static or exe.vm_for_batch(args.batch) is not exe.vm)
    kernels = sum(r.calls for r in prof.rows)
    print(f"{args.net}, correlation {net.plan.correlation}, batch {args.batch}, {args.threads} thread(s), "
          f"{'static' if args.static else 'any-batch'} executable, method {args.method}, load average "
          f"{os.getloadavg()[0]:.1f}; compile {compile_s:.1f} CPU s; {kernels} kernel calls per exe(x)")
    if args.kernels:
        print(prof.table(""))
    per_op: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    for row in prof.rows:
        per_op[row.op][0] += row.calls
        per_op[row.op][1] += row.us
    print(f"{'op':22s} {'calls':>6s} {'us':>10s} {'share':>7s}")
    for op, (calls, us) in sorted(per_op.items(), key=lambda kv: -kv[1][1]):
        print(f"{op:22s} {calls:6d} {us:10.1f} {100 * us / prof.total_us:6.1f}%")
    print(f"{'total':22s} {'':6s} {prof.total_us:10.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
