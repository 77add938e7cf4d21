#!/usr/bin/python3
"""bench/scaling_model.py: the tensor-parallel scaling model of docs/scaling.md, printed as markdown.

time per call on N ranks = compute_1 * ceil(H/N)/H  +  allreduce(bytes, N), with the ring all-reduce
allreduce(n, N) = 2(N-1) alpha + 2(N-1)/N * n / bw. It fits alpha and bw to bench/mpi_allreduce's JSON lines
itself, reads single-rank compute times from `gpt2attn bench --json` lines, projects them over published
interconnect figures, and, given --measured, sets the model beside `mpirun -np N gpt2attn bench --json` rows.
It measures nothing and invents nothing: a case or rank count without a row says so.

usage: scaling_model.py --allreduce AR.jsonl --compute C.jsonl [--measured M.jsonl ...] [--ranks 2,4,...]
"""
import argparse
import json
import math
import os
import sys

# Widths and heads of the compiled-in presets (`build/gpt2attn presets`): E d_model, H heads.
PRESETS = {
    "gpt2-small": (768, 12), "gpt2-medium": (1024, 16), "gpt2-large": (1280, 20), "gpt2-xl": (1600, 25),
    "gpt3-small": (768, 12), "gpt3-medium": (1024, 16), "gpt3-large": (1536, 16), "gpt3-xl": (2048, 16),
    "gpt3-2.7b": (2560, 32), "gpt3-6.7b": (4096, 32), "gpt3-13b": (5120, 40), "gpt3-175b": (12288, 96),
}

# Published interconnect figures: alpha = small-message MPI latency (one way), bw = bytes/s one link carries.
# None of these was measured here; each names its source (docs/scaling.md quotes them with the same links).
NETWORKS = [
    # 25 GbE, kernel TCP. bw: iperf3 between two AWS c5.18xlarge ("25 Gbps connectivity via TCP") reached
    # "over 24 Gbps" (https://github.com/open-mpi/ompi/issues/6521). alpha: sockperf ping-pong through the Linux
    # kernel TCP stack between two directly connected 10 GbE NICs, 17.8 us
    # (https://github.com/F-Stack/f-stack/issues/540); the kernel stack, not the link rate, sets TCP's small-message
    # latency, and a switch adds to it, so this is optimistic for a switched 25 GbE network.
    {"name": "25GbE-TCP", "label": "25GbE TCP", "alpha_s": 17.8e-6, "bw_Bps": 24e9 / 8},
    # 100 Gb/s Ethernet with OS bypass: AWS EFA on hpc6a (100 Gbps), Intel MPI 2021.6, osu_latency
    # (https://github.com/aws/aws-parallelcluster/issues/6449): 9.87 us at 1 B; bw is that table's large-message
    # slope, (4194304 - 2097152) B / (725.62 - 379.37) us = 6.06 GB/s, about half the 12.5 GB/s line rate.
    {"name": "100GbE-EFA", "label": "100GbE EFA", "alpha_s": 9.87e-6, "bw_Bps": 2097152 / 346.25e-6},
    # InfiniBand HDR 200 Gb/s: Azure HBv3 (ConnectX-6 HDR) published "1.2 microseconds (1-byte), 192 Gb/s
    # (one-way)" (https://learn.microsoft.com/azure/virtual-machines/hbv3-performance, source
    # https://github.com/MicrosoftDocs/azure-docs/blob/main/articles/virtual-machines/hbv3-performance.md).
    {"name": "IB-HDR", "label": "IB HDR", "alpha_s": 1.2e-6, "bw_Bps": 192e9 / 8},
]


def read_jsonl(path):
    rows = []
    try:
        f = open(path)
    except OSError as e:
        sys.exit(f"scaling_model.py: {e}")
    with f:
        for i, line in enumerate(f, 1):
            line = line.strip()
            if not line.startswith("{"):
                continue  # mpirun banners, blank lines
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                sys.exit(f"scaling_model.py: {path}:{i}: not JSON ({e})")
    return rows


# --- the all-reduce fit ------------------------------------------------------------------------------------------

class RingFit:
    """allreduce(n, N) = 2(N-1) alpha + 2(N-1)/N * n / bw(n); bw(n) = bw below knee_bytes, bw_big from it on
    (one bandwidth when bw_big is None). Times in seconds, sizes in bytes."""

    def __init__(self, ranks, alpha, bw, bw_big=None, knee_bytes=None):
        self.ranks, self.alpha, self.bw, self.bw_big, self.knee_bytes = ranks, alpha, bw, bw_big, knee_bytes

    def __call__(self, nbytes, N):
        if N <= 1:
            return 0.0  # one rank: nothing to sum (MPI_IN_PLACE on one rank moves no bytes)
        bw = self.bw_big if (self.bw_big is not None and nbytes >= self.knee_bytes) else self.bw
        return 2 * (N - 1) * self.alpha + 2 * (N - 1) / N * nbytes / bw


def relative_slope(n, r, weight_t):
    """c minimising sum(((r_i - c n_i) / t_i)^2): least squares in relative error, so each size counts alike."""
    w = [1.0 / t ** 2 for t in weight_t]
    return sum(wi * ni * ri for wi, ni, ri in zip(w, n, r)) / sum(wi * ni * ni for wi, ni in zip(w, n))


def fit_ring(rows, N, alpha_max_bytes, bw_min_bytes, knee_bytes):
    """alpha from the sizes up to alpha_max_bytes (the bandwidth term is a few percent of their time at most), bw
    from the sizes in [bw_min_bytes, knee_bytes), bw_big from knee_bytes on; each by least squares in relative
    error."""
    pts = sorted((r["bytes"], r["median_us"] * 1e-6) for r in rows if r.get("ranks") == N)
    if N < 2 or not pts:
        return None
    small = [t for n, t in pts if n <= alpha_max_bytes]
    if not small:
        sys.exit(f"scaling_model.py: no all-reduce sizes <= {alpha_max_bytes} B for {N} ranks to fit alpha")
    alpha = sum(small) / len(small) / (2 * (N - 1))
    steps, share = 2 * (N - 1) * alpha, 2 * (N - 1) / N

    def bw_over(sel):
        if not sel:
            return None
        c = relative_slope([n for n, _ in sel], [t - steps for _, t in sel], [t for _, t in sel])
        return share / c

    bw = bw_over([(n, t) for n, t in pts if bw_min_bytes <= n < knee_bytes])
    bw_big = bw_over([(n, t) for n, t in pts if n >= knee_bytes])
    if bw is None and bw_big is None:
        sys.exit(f"scaling_model.py: no all-reduce sizes >= {bw_min_bytes} B for {N} ranks to fit bw")
    if bw is None:
        bw, bw_big = bw_big, None
    return RingFit(N, alpha, bw, bw_big, knee_bytes)


def interpolate_measured(rows, N, nbytes):
    """The measured all-reduce time at nbytes, log-log between the two measured sizes around it (None outside)."""
    pts = sorted((r["bytes"], r["median_us"] * 1e-6) for r in rows if r.get("ranks") == N)
    for (n0, t0), (n1, t1) in zip(pts, pts[1:]):
        if n0 <= nbytes <= n1:
            f = (math.log(nbytes) - math.log(n0)) / (math.log(n1) - math.log(n0))
            return math.exp(math.log(t0) + f * (math.log(t1) - math.log(t0)))
    return None


# --- cases --------------------------------------------------------------------------------------------------------

def case_key(row):
    return (row["preset"], row["mode"], int(row["batch"]), int(row["seq"]), row.get("dtype", "f32"),
            int(row.get("threads", 0)))


def case_name(key):
    preset, mode, B, T, dtype, threads = key
    what = f"prefill B={B} T={T}" if mode == "prefill" else f"decode B={B} (context {T})"
    return f"{preset} {what}, {dtype}, {threads} thread(s) per rank"


def message_bytes(key):
    """The all-reduce moves the (B, T, E) f32 output: T tokens in prefill, one per sequence in decode."""
    preset, mode, B, T, _, _ = key
    E, _ = PRESETS[preset]
    return B * (T if mode == "prefill" else 1) * E * 4


def compute_share(H, N):
    """The slowest rank's share of the heads: ceil(H/N)/H (1/N when N divides H)."""
    return math.ceil(H / N) / H


def fmt_ms(s):
    ms = s * 1e3
    return f"{ms:.3g}" if ms < 100 else f"{ms:.0f}"


def fmt_bytes(n):
    for unit, k in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= k:
            return f"{n / k:.3g} {unit}"
    return f"{n} B"


# --- output -------------------------------------------------------------------------------------------------------

def print_fits(fits, rows, knee_bytes):
    print("## All-reduce fits (shared memory, this machine)\n")
    print("| ranks | alpha (us) | bw below knee (GB/s) | bw from knee (GB/s) |")
    print("|---:|---:|---:|---:|")
    for N, f in sorted(fits.items()):
        big = f"{f.bw_big / 1e9:.2f}" if f.bw_big else "-"
        print(f"| {N} | {f.alpha * 1e6:.3f} | {f.bw / 1e9:.2f} | {big} |")
    print(f"\nknee = {fmt_bytes(knee_bytes)}. Model against measurement (model/measured), every other power of 2:\n")
    Ns = sorted(fits)
    print("| bytes | " + " | ".join(f"{N} ranks: measured us | model us | ratio" for N in Ns) + " |")
    print("|---:|" + "---:|---:|---:|" * len(Ns))
    sizes = sorted({r["bytes"] for r in rows if r.get("ranks") in fits})
    for n in sizes:
        if int(math.log2(n)) % 2 and n != sizes[-1]:
            continue
        cells = []
        for N in Ns:
            m = [r["median_us"] for r in rows if r.get("ranks") == N and r["bytes"] == n]
            if not m:
                cells.append("- | - | -")
                continue
            model = fits[N](n, N) * 1e6
            cells.append(f"{m[0]:.3g} | {model:.3g} | {model / m[0]:.2f}")
        print(f"| {fmt_bytes(n)} | " + " | ".join(cells) + " |")
    print()


def interconnects(shm_fit):
    """[{label, f(nbytes, N) -> seconds}]: this machine's shared-memory fit, then the published NETWORKS."""
    nets = [{"label": f"shm ({shm_fit.ranks}-rank fit)", "f": lambda n, N: shm_fit(n, N)}]
    for net in NETWORKS:
        nets.append({"label": net["label"],
                     "f": (lambda a, b: lambda n, N: 2 * (N - 1) * a + 2 * (N - 1) / N * n / b)(net["alpha_s"],
                                                                                               net["bw_Bps"])})
    return nets


def first_crossing(f, nbytes, compute_s, H, top):
    """The first N in 2..top at which the all-reduce exceeds the slowest rank's compute, or None."""
    return next((N for N in range(2, top + 1) if f(nbytes, N) > compute_s * compute_share(H, N)), None)


def print_summary(compute, shm_fit, ranks_list):
    nets = interconnects(shm_fit)
    print("| case | message | compute_1 ms | N max | " + " | ".join(f"{n['label']}: a > c from N | c/a at N max"
                                                              for n in nets) + " |")
    print("|---|---:|---:|---:|" + "---:|---:|" * len(nets))
    for key in sorted(compute, key=case_order):
        _, H = PRESETS[key[0]]
        nbytes, c1 = message_bytes(key), compute[key]
        top = min(H, max(ranks_list))
        cells = []
        for n in nets:
            cross = first_crossing(n["f"], nbytes, c1, H, top)
            r = c1 * compute_share(H, top) / n["f"](nbytes, top)
            cells.append(f"{cross if cross else 'never'} | " + (f"**{r:.3g}**" if r < 1 else f"{r:.3g}"))
        name = case_name(key).split(",")[0]
        print(f"| {name} | {fmt_bytes(nbytes)} | {fmt_ms(c1)} | {top} | " + " | ".join(cells) + " |")
    print()


def print_projection(key, compute_s, shm_fit, ranks_list):
    preset, mode, B, T, _, _ = key
    E, H = PRESETS[preset]
    nbytes = message_bytes(key)
    nets = interconnects(shm_fit)
    print(f"### {case_name(key)}\n")
    shape = "B*T*E*4" if mode == "prefill" else "B*E*4"
    print(f"compute_1 = {fmt_ms(compute_s)} ms (one rank, measured); all-reduce message {shape} = {nbytes} B "
          f"({fmt_bytes(nbytes)}); E = {E}, H = {H}.\n")
    print("| N | heads/rank | compute ms | " + " | ".join(f"{n['label']} all-reduce ms | c/a" for n in nets) + " |")
    print("|---:|---:|---:|" + "---:|---:|" * len(nets))
    shown = [N for N in ranks_list if N <= H] + ([H] if any(N > H for N in ranks_list) else [])
    capped = any(N > H for N in ranks_list)
    for N in shown:
        c = compute_s * compute_share(H, N)
        cells = []
        for n in nets:
            a = n["f"](nbytes, N)
            ratio = f"{c / a:.3g}" if c / a < 1000 else f"{c / a:.0f}"
            cells.append(f"{fmt_ms(a)} | " + (f"**{ratio}**" if a > c else ratio))
        label = f"{N} (= H)" if (capped and N == H) else str(N)
        print(f"| {label} | {math.ceil(H / N)} | {fmt_ms(c)} | " + " | ".join(cells) + " |")
    print()
    if capped:
        print(f"N > H = {H} is impossible (a rank holds at least one head): rows "
              f"{', '.join(str(N) for N in ranks_list if N > H)} are replaced by N = {H}.\n")
    top = min(H, max(ranks_list))
    print(f"Bold: c/a below 1. First N (2..{top}) where the all-reduce exceeds the compute term, and the best "
          f"speedup compute_1/time(N) there:\n")
    for n in nets:
        cross = first_crossing(n["f"], nbytes, compute_s, H, top)
        best = max(range(1, top + 1), key=lambda N: compute_s / (compute_s * compute_share(H, N) + n["f"](nbytes, N)))
        best_speedup = compute_s / (compute_s * compute_share(H, best) + n["f"](nbytes, best))
        where = f"from N = {cross}" if cross else f"never up to N = {top}"
        print(f"- {n['label']}: {where}; best speedup {best_speedup:.2f}x at N = {best}")
    print()


def case_order(key):
    return (key[0], key[1] != "prefill", key[2], key[3], key[4], key[5])


def print_check(measured_rows, have_measured, compute, fits, ar_rows, check_ranks, cores):
    """This machine's model for N = check_ranks beside the measured rows, when given. Without --measured the model
    columns alone are printed for every --compute case."""
    print("## Checked against this machine\n")
    print(f"Model for this machine: compute_1 * ceil(H/N)/H / min(1, {cores} cores / (N ranks * threads)) + the "
          f"all-reduce fitted to this machine's mpi_allreduce rows for the same N (0 for N = 1).\n")
    by_key = {}
    no_ranks = 0
    for r in measured_rows:
        if "ranks" not in r:
            no_ranks += 1
        by_key.setdefault(case_key(r), {}).setdefault(int(r.get("ranks", 1)), []).append(r)
    if not have_measured:
        print("No --measured rows were given: the model alone.\n")
        by_key = {k: {} for k in compute}
    elif no_ranks:
        print(f"Note: {no_ranks} measured row(s) carry no \"ranks\" field: read as one-process runs (N = 1).\n")
    if have_measured and not by_key:
        print("The --measured files hold no bench rows: nothing to compare.\n")
        return
    for key in sorted(by_key, key=case_order):
        preset = key[0]
        threads = key[5]
        E, H = PRESETS[preset]
        nbytes = message_bytes(key)
        base = compute.get(key)
        print(f"### {case_name(key)}\n")
        if base is None:
            print("No single-rank `gpt2attn bench` row for this case in --compute: no model to compare with.\n")
            continue
        print(f"compute_1 = {fmt_ms(base)} ms; message {fmt_bytes(nbytes)}.\n")
        cols = "| N | model compute ms | model all-reduce ms | mpi_allreduce, interpolated ms | model ms |"
        rule = "|---:|---:|---:|---:|---:|"
        if have_measured:
            cols += " measured ms | measured all-reduce ms | measured/model | all-reduce measured/model |"
            rule += "---:|---:|---:|---:|"
        print(cols)
        print(rule)
        missing = []
        for N in check_ranks:
            slots = N * max(threads, 1)
            c = base * compute_share(H, N) / min(1.0, cores / slots)
            fit = fits.get(N)
            a = None if (N > 1 and fit is None) else (fit(nbytes, N) if fit else 0.0)
            a_txt = "no all-reduce rows for this N" if a is None else fmt_ms(a)
            model_txt = "-" if a is None else fmt_ms(c + a)
            meas_ar = interpolate_measured(ar_rows, N, nbytes) if N > 1 else None
            meas_ar_txt = fmt_ms(meas_ar) if meas_ar is not None else "-"
            line = f"| {N} | {fmt_ms(c)} | {a_txt} | {meas_ar_txt} | {model_txt} |"
            if have_measured:
                rows = by_key[key].get(N)
                if not rows:
                    missing.append(N)
                    line += " no measurement | - | - | - |"
                else:
                    if len(rows) > 1:
                        print(f"<!-- {len(rows)} rows for N = {N}; the first is used -->")
                    r = rows[0]
                    m_ar = r.get("allreduce_ms")
                    ratio = "-" if a is None else f"{r['median_ms'] / ((c + a) * 1e3):.2f}"
                    ar_ratio = f"{m_ar / (a * 1e3):.2f}" if (m_ar is not None and a) else "-"
                    m_ar_txt = f"{m_ar:.3g}" if m_ar is not None else "not in row"
                    line += f" {r['median_ms']:.3g} | {m_ar_txt} | {ratio} | {ar_ratio} |"
            print(line)
        print()
        for N in missing:
            print(f"- N = {N}: no measurement (no row with \"ranks\": {N} for this case).")
        if missing:
            print()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--allreduce", required=True, help="JSON lines from bench/mpi_allreduce (any rank counts)")
    ap.add_argument("--compute", required=True, help="JSON lines from single-process `gpt2attn bench --json`")
    ap.add_argument("--measured", action="append", default=[],
                    help="JSON lines from `mpirun -np N gpt2attn bench --json` (repeatable)")
    ap.add_argument("--ranks", default="2,4,8,16,32,64", help="rank counts to project (default 2,4,8,16,32,64)")
    ap.add_argument("--check-ranks", default="1,2,3", help="rank counts the --measured comparison expects")
    ap.add_argument("--check-preset", action="append", default=[],
                    help="limit the check section to these presets (repeatable; default: every case)")
    ap.add_argument("--check-only", action="store_true",
                    help="print only the 'Checked against this machine' section (what docs/scaling.md pastes)")
    ap.add_argument("--cores", type=int, default=os.cpu_count(), help="cores of the measured machine")
    ap.add_argument("--alpha-max-bytes", type=int, default=256)
    ap.add_argument("--bw-min-bytes", type=int, default=64 << 10)
    ap.add_argument("--knee-bytes", type=int, default=32 << 20,
                    help="from this size on, shared-memory bandwidth is fitted apart (default 32 MiB, where this "
                         "machine's measured bandwidth drops)")
    ap.add_argument("--shm-fit-ranks", type=int, default=None,
                    help="which rank count's fit projects shared memory (default: the smallest measured, >= 2)")
    args = ap.parse_args()

    try:
        ranks_list = [int(x) for x in args.ranks.split(",")]
        check_ranks = [int(x) for x in args.check_ranks.split(",")]
    except ValueError:
        sys.exit("scaling_model.py: --ranks and --check-ranks take comma-separated integers")
    if any(N < 1 for N in ranks_list + check_ranks) or args.cores < 1:
        sys.exit("scaling_model.py: rank counts and --cores must be >= 1")

    ar_rows = read_jsonl(args.allreduce)
    fits = {}
    for N in sorted({int(r["ranks"]) for r in ar_rows if "ranks" in r}):
        f = fit_ring(ar_rows, N, args.alpha_max_bytes, args.bw_min_bytes, args.knee_bytes)
        if f:
            fits[N] = f
    if not fits:
        sys.exit(f"scaling_model.py: {args.allreduce} has no all-reduce rows for 2 or more ranks")
    shm_N = args.shm_fit_ranks or min(fits)
    if shm_N not in fits:
        sys.exit(f"scaling_model.py: --shm-fit-ranks {shm_N}: no all-reduce rows for that many ranks")

    compute = {}
    for r in read_jsonl(args.compute):
        if r.get("ranks", 1) != 1:
            continue
        if r["preset"] not in PRESETS:
            sys.exit(f"scaling_model.py: preset {r['preset']!r} is not in PRESETS")
        compute[case_key(r)] = r["median_ms"] * 1e-3
    if not compute:
        sys.exit(f"scaling_model.py: {args.compute} has no single-rank bench rows")

    if not args.check_only:
        print_fits(fits, ar_rows, args.knee_bytes)
        print("## Projection\n")
        print(f"time(N) = compute_1 * ceil(H/N)/H + allreduce(bytes, N); speedup = compute_1 / time(N). Shared memory "
              f"uses this machine's {shm_N}-rank fit; the networks use the published alpha and bw in NETWORKS.\n")
        print("c/a = compute / all-reduce, the slowest rank's compute term over the all-reduce at that N: how many "
              "times faster a rank's compute could be before the all-reduce matched it; bold where it is below 1 "
              "(the all-reduce already exceeds the compute term).\n")
        print("Summary: the first N (2..N max) at which the all-reduce exceeds the compute term ('never' when it does "
              "not), and c/a at N max = min(H, largest --ranks).\n")
        print_summary(compute, fits[shm_N], ranks_list)
        for key in sorted(compute, key=case_order):
            print_projection(key, compute[key], fits[shm_N], ranks_list)

    measured = []
    for path in args.measured:
        measured += read_jsonl(path)
    if args.check_preset:
        measured = [r for r in measured if r.get("preset") in args.check_preset]
        compute_checked = {k: v for k, v in compute.items() if k[0] in args.check_preset}
    else:
        compute_checked = compute
    print_check(measured, bool(args.measured), compute_checked, fits, ar_rows, check_ranks, args.cores)


if __name__ == "__main__":
    main()
