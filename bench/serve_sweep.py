#!/usr/bin/env python3
"""Latency against load for `gpt2attn serve`: one server, bench/load_gen.py at each --rates value in turn, a table and
a plot (TTFT and inter-token latency percentiles against the offered rate).

Usage: bench/serve_sweep.py --cli build/gpt2attn (--model DIR | --preset NAME) [--rates 1,2,4] [--duration 20]
                            [--prompt-len uniform:16:256] [--output-len uniform:16:128] [--threads 2]
                            [--plot bench/plots/serve_latency.png] [--json]
"""
import argparse
import json
import os
import re
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cli", required=True)
    ap.add_argument("--model")
    ap.add_argument("--preset")
    ap.add_argument("--rates", default="1,2,4")
    ap.add_argument("--duration", type=float, default=20.0)
    ap.add_argument("--prompt-len", default="uniform:16:256")
    ap.add_argument("--output-len", default="uniform:16:128")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--plot", default=os.path.join(HERE, "plots", "serve_latency.png"))
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    src = ["--model", a.model] if a.model else ["--preset", a.preset]
    server = subprocess.Popen([a.cli, "serve"] + src + ["--threads", str(a.threads), "--port", "0"],
                              stdout=subprocess.PIPE, text=True)
    try:
        line = server.stdout.readline()
        m = re.search(r"listening on (http://\S+)", line)
        if not m:
            sys.exit("serve_sweep: the server said %r" % line)
        url = m.group(1)
        rows = []
        for rate in (float(r) for r in a.rates.split(",")):
            out = subprocess.run([sys.executable, os.path.join(HERE, "load_gen.py"), "--url", url, "--rate", str(rate),
                                  "--duration", str(a.duration), "--prompt-len", a.prompt_len, "--output-len",
                                  a.output_len], check=True, capture_output=True, text=True).stdout
            r = json.loads(out)
            r["offered_rate"] = rate
            rows.append(r)
            if a.json:
                print(json.dumps({k: v for k, v in r.items() if k != "server_metrics"}), flush=True)
    finally:
        server.terminate()
        server.wait(timeout=60)
    if not a.json:
        print("| offered req/s | answered | refused | req/s | tokens/s | TTFT p50 / p90 ms | inter-token p50 / p90 / p99 ms "
              "| end-to-end p50 ms |")
        print("|---|---|---|---|---|---|---|---|")
        for r in rows:
            t, i, e = r["ttft_ms"], r["itl_ms"], r["e2e_ms"]
            print(f"| {r['offered_rate']:g} | {r['answered']} | {sum(r['refused'].values())} | {r['requests_per_s']:.2f} | "
                  f"{r['tokens_per_s']:.1f} | {t['p50']:.0f} / {t['p90']:.0f} | {i['p50']:.1f} / {i['p90']:.1f} / "
                  f"{i['p99']:.1f} | {e['p50']:.0f} |")
    if a.plot:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        x = [r["offered_rate"] for r in rows]
        fig, ax = plt.subplots(1, 2, figsize=(9, 3.5))
        for q in ("p50", "p90"):
            ax[0].plot(x, [r["ttft_ms"][q] for r in rows], marker="o", label="TTFT " + q)
            ax[1].plot(x, [r["itl_ms"][q] for r in rows], marker="o", label="inter-token " + q)
        for k, title in ((0, "time to first token"), (1, "inter-token latency")):
            ax[k].set_xlabel("offered load (requests/s, Poisson)")
            ax[k].set_ylabel("ms")
            ax[k].set_title(title)
            ax[k].legend()
            ax[k].grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(a.plot, dpi=110)
    return 0


if __name__ == "__main__":
    sys.exit(main())
