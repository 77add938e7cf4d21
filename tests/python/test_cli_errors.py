# tests/python/test_cli_errors.py: the CLI's bad-input contract. Every bad input exits 2 with exactly one
# clear stderr line naming the problem, no signal or trace dump, and no output file left behind.
# Also `gpt2attn presets` and `gpt2attn --help` succeed, `forward --dtype bf16` runs, and --output follows links
# but never replaces a device or FIFO. Numerical results are the other scripts' business.
import json
import os
import re
import stat
import struct
import subprocess
import sys
import time

import numpy as np
import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import parity_common as pc  # noqa: E402
from parity_common import check  # noqa: E402

E, H, B, T = 8, 2, 2, 3
DUMP_MARKERS = ("Traceback", "terminate called", "Aborted", "core dumped", "Segmentation", "what():",
                "AddressSanitizer", "stack trace")


class Fixture:
    """A valid weights file and valid inputs; each case breaks one thing."""

    def __init__(self, r):
        self.r = r
        self.dir = r.workdir()
        torch.manual_seed(0)
        m = nn.MultiheadAttention(E, H, batch_first=True)
        self.sd = pc.state_dict_of(m)
        self.weights = self.path("w.safetensors")
        self.st_bytes = pc.safetensors_bytes(self.sd)
        with open(self.weights, "wb") as f:
            f.write(self.st_bytes)
        g = np.random.default_rng(0)
        self.q = self.npy("q.npy", g.standard_normal((B, T, E)).astype(np.float32))
        self.kv = self.npy("kv.npy", g.standard_normal((B, 5, E)).astype(np.float32))

    def path(self, name):
        return os.path.join(self.dir, name)

    def npy(self, name, a):
        return pc.save_npy(self.path(name), a)

    def raw(self, name, data):
        with open(self.path(name), "wb") as f:
            f.write(data)
        return self.path(name)

    def st(self, name, tensors=None, **kw):
        return pc.write_safetensors(self.path(name), self.sd if tensors is None else tensors, **kw)

    def fwd(self, weights=None, query=None, drop=(), extra=()):
        """forward args with the valid defaults; `drop` removes options (and their values) by name."""
        opts = [("--weights", weights or self.weights), ("--heads", H), ("--query", query or self.q)]
        return ["forward"] + [str(x) for o in opts if o[0] not in drop for x in o] + [str(x) for x in extra]


def expect_error(r, args, keywords, output=None, tail=(), with_output=True, output_exists=False):
    """Runs the CLI and checks the bad-input contract; keywords: any one must appear (case-insensitive).
    --output comes after args (unless with_output is False, as for bench), then tail (for an option left
    without its value at the very end). output_exists: --output names something the case made beforehand."""
    wd = r.workdir()
    out = output or os.path.join(wd, "y.npy")
    args = list(args) + (["--output", out] if with_output else []) + [str(x) for x in tail]
    p = pc.run_cli(r.cli, args)
    cmd = pc.fmt_cmd(r.cli, args)
    check(p.returncode >= 0, "killed by signal %d: %s" % (-p.returncode, cmd))
    check(p.returncode == 2, "exit %d, expected 2: %s; stderr: %r" % (p.returncode, cmd, p.stderr[-300:]))
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    check(len(lines) == 1, "expected exactly one stderr line, got %d: %r (%s)" % (len(lines), p.stderr[-400:], cmd))
    for marker in DUMP_MARKERS:
        check(marker.lower() not in p.stderr.lower(), "stderr looks like a dump (%r): %r" % (marker, lines[0]))
    check(any(re.search(k, lines[0], re.I) for k in keywords),
          "stderr does not mention %s: %r (%s)" % (" / ".join(keywords), lines[0], cmd))
    check(output_exists or not os.path.exists(out), "output file exists after failure: %s" % cmd)
    return "stderr: %s" % lines[0]


def main():
    r = pc.Runner("bad input contract of the gpt2attn CLI")
    fx = Fixture(r)
    err = lambda name, args, keywords, **kw: r.case(name, expect_error, r, args, keywords, **kw)  # noqa: E731

    # --- weights file ---
    err("missing_weights_option", fx.fwd(drop=("--weights",)), ["weights"])
    # --config: a Hugging Face GPT-2 config.json says the heads; disagreeing or missing pieces are refused
    hf = lambda name, cfg: fx.raw(name, json.dumps(cfg).encode())  # noqa: E731
    good = {"model_type": "gpt2", "n_embd": E, "n_head": H, "n_positions": 16}
    err("missing_heads_and_config", fx.fwd(drop=("--heads",)), ["--heads", "--config"])
    err("heads_disagree_with_config", fx.fwd(extra=["--config", hf("c1.json", good)], drop=("--heads",)) +
        ["--heads", str(2 * H)], ["disagrees", "heads"])
    err("config_width_disagrees_with_weights", fx.fwd(extra=["--config", hf("c2.json", dict(good, n_embd=2 * E,
                                                                                       n_head=2 * H))],
                                                      drop=("--heads",)), ["d_model", "wide"])
    err("config_without_n_head", fx.fwd(extra=["--config", hf("c3.json", {"n_embd": E, "n_positions": 16})],
                                        drop=("--heads",)), ["n_head"])
    err("config_not_json", fx.fwd(extra=["--config", fx.raw("c4.json", b"{n_embd: 8")], drop=("--heads",)),
        ["JSON", "json"])
    err("config_missing_file", fx.fwd(extra=["--config", fx.path("none.json")], drop=("--heads",)),
        ["none.json"])
    err("t_past_config_context", fx.fwd(extra=["--config", hf("c5.json", dict(good, n_positions=2))],
                                        drop=("--heads",)), ["context_length", "context"])
    # Every field of a config file applies or is refused, never silently dropped (before, only the heads, the
    # context and d_model were read: num_kv_heads, the biases and causal were ignored).
    ours = {"d_model": E, "num_heads": H}
    err("config_kv_heads_disagree_with_weights",
        fx.fwd(extra=["--config", hf("c6.json", dict(ours, num_kv_heads=1))], drop=("--heads",)),
        [r"w\.safetensors: the file's K/V projections have 8 outputs but the config asks for 1 K/V heads"])
    err("kv_heads_flag_disagrees_with_config",
        fx.fwd(extra=["--config", hf("c7.json", dict(ours, num_kv_heads=1)), "--kv-heads", "2"], drop=("--heads",)),
        [r"--kv-heads 2 disagrees with .*c7\.json, which says 1 K/V heads"])
    # A config naming no K/V heads (every Hugging Face GPT-2 config, every configs/*.json) has as many as heads;
    # grouped-query weights were accepted with it, and so was a --kv-heads that disagreed.
    err("config_without_kv_heads_refuses_grouped_weights",
        fx.fwd(weights=fx.st("gqa.safetensors", grouped_state_dict(fx.sd, kv_heads=1)),
               extra=["--config", hf("c10.json", good)], drop=("--heads",)),
        [r"K/V projections have 4 outputs but the config asks for 2 K/V heads"])
    err("kv_heads_flag_disagrees_with_config_without_kv_heads",
        fx.fwd(extra=["--config", hf("c11.json", good), "--kv-heads", "1"], drop=("--heads",)),
        [r"--kv-heads 1 disagrees with .*c11\.json, which says 2 K/V heads"])
    err("config_bias_disagrees_with_weights",
        fx.fwd(extra=["--config", hf("c8.json", dict(ours, qkv_bias=False))], drop=("--heads",)),
        [r"c8\.json says qkv_bias false but the weights in .*w\.safetensors have qkv_bias true"])
    r.case("config_causal_applies", lambda: config_causal_applies(r, fx, hf("c9.json", dict(ours, causal=True)),
                                                                  hf("c10.json", good)))
    r.case("gpt2_layout_is_causal", lambda: gpt2_layout_is_causal(r, fx))
    err("causal_and_no_causal", fx.fwd(extra=["--causal", "--no-causal"]), ["--causal and --no-causal contradict"])
    err("no_causal_against_a_causal_config",
        fx.fwd(extra=["--config", hf("c12.json", good), "--no-causal"], drop=("--heads",)),
        [r"--no-causal disagrees with .*c12\.json, which says the layer is causal"])
    # A file of another format is named, with the script that converts a state dict.
    pt_zip, pt_pickle = fx.path("w.pt"), fx.path("w_legacy.pt")
    torch.save(fx.sd, pt_zip)
    torch.save(fx.sd, pt_pickle, _use_new_zipfile_serialization=False)
    for name, path, what in (("weights_torch_zip", pt_zip, "zip archive"),
                             ("weights_torch_pickle", pt_pickle, "Python pickle"),
                             ("weights_npy", fx.q, r"\.npy array")):
        err(name, fx.fwd(weights=path), [what + r".*not a safetensors file.*scripts/export_safetensors\.py"])
    err("weights_file_missing", fx.fwd(weights=fx.path("nope.safetensors")),
        ["nope\\.safetensors", "no such", "not found", "does not exist", "cannot open"])
    err("weights_truncated", fx.fwd(weights=fx.raw("trunc.safetensors", fx.st_bytes[:-20])),
        ["truncat", "offset", "size", "short", "end of file", "past"])
    err("weights_file_shorter_than_8_bytes", fx.fwd(weights=fx.raw("tiny.safetensors", b"\x10\x00")),
        ["truncat", "header", "short", "size", "too small"])
    err("weights_header_length_huge",
        fx.fwd(weights=fx.raw("huge.safetensors", struct.pack("<Q", 1 << 62) + fx.st_bytes[8:])),
        ["header"])
    not_json = b"{this is not json}      "
    err("weights_header_not_json",
        fx.fwd(weights=fx.raw("nojson.safetensors", struct.pack("<Q", len(not_json)) + not_json + b"\0" * 64)),
        ["json", "header", "parse"])

    def past_end(h):  # the span stays the right size, but it starts and ends past the data section
        h["out_proj.weight"]["data_offsets"] = [o + 4096 for o in h["out_proj.weight"]["data_offsets"]]
    err("weights_offsets_past_end", fx.fwd(weights=fx.st("past.safetensors", header_override=past_end)),
        ["offset", "end", "truncat", "size", "bound", "past"])

    def wrong_shape(h):
        h["out_proj.weight"]["shape"] = [E, E + 1]
    err("weights_shape_disagrees_with_bytes", fx.fwd(weights=fx.st("shape.safetensors", header_override=wrong_shape)),
        ["shape", "size", "offset", "bytes", "out_proj"])
    bad_out = dict(fx.sd)
    bad_out["out_proj.weight"] = torch.zeros(E, E + 2)
    err("weights_out_proj_wrong_shape", fx.fwd(weights=fx.st("outw.safetensors", bad_out)),
        ["out_proj", "shape"])
    err("weights_f64_dtype_unsupported", fx.fwd(weights=fx.st("f64.safetensors", dtype="F64")),
        ["dtype", "F64", "unsupported"])
    err("weights_wrong_prefix", fx.fwd(extra=["--prefix", "h.9.attn."]),
        ["prefix", "h\\.9\\.attn", "not found", "in_proj_weight", "c_attn"])
    err("weights_no_attention_tensors",
        fx.fwd(weights=fx.st("other.safetensors", {"wte.weight": torch.zeros(4, E)})),
        ["in_proj_weight", "c_attn", "not found", "no attention", "missing"])

    # --- options ---
    err("heads_not_dividing_E", ["forward", "--weights", fx.weights, "--heads", 3, "--query", fx.q],
        ["head", "divis", "divide"])
    err("heads_zero", ["forward", "--weights", fx.weights, "--heads", 0, "--query", fx.q], ["head"])
    err("missing_heads", fx.fwd(drop=("--heads",)), ["head"])
    err("missing_query", fx.fwd(drop=("--query",)), ["query"])
    r.case("missing_output", lambda: expect_missing_output(r, fx))
    err("unknown_option", fx.fwd(extra=["--frobnicate"]), ["unknown", "unrecognized", "option", "frobnicate"])
    err("threads_negative", fx.fwd(extra=["--threads", "-1"]), ["thread"])
    err("threads_not_a_number", fx.fwd(extra=["--threads", "two"]), ["thread"])
    err("context_length_not_a_number", fx.fwd(extra=["--context-length", "12x"]), ["context"])
    err("option_missing_value_at_end", fx.fwd(), ["thread", "value", "missing"], tail=["--threads"])
    err("unknown_mask_kind", fx.fwd(extra=["--mask", fx.npy("mk.npy", np.ones((T, T), bool)),
                                           "--mask-kind", "sometimes"]),
        ["mask-kind", "mask kind", "kind", "sometimes"])
    err("unwritable_output_dir", fx.fwd(), ["output", "no such", "cannot", "write", "open"],
        output=os.path.join(fx.dir, "no_such_dir", "y.npy"))

    # --- --dtype: f32 or bf16, once (bench takes it repeated, each value once) ---
    dtype_values = r"--dtype.*\bf32\b.*\bbf16\b"  # names the option and both supported values
    err("dtype_fp16_unsupported", fx.fwd(extra=["--dtype", "fp16"]), [r"--dtype fp16\b.*f32, bf16"])
    err("dtype_int8_unsupported", fx.fwd(extra=["--dtype", "int8"]), [dtype_values])
    err("dtype_given_twice", fx.fwd(extra=["--dtype", "bf16", "--dtype", "f32"]),
        [r"--dtype.*(more than once|twice)"])
    err("dtype_missing_value_at_end", fx.fwd(), [r"--dtype.*value"], tail=["--dtype"])
    err("bench_dtype_fp8_unsupported", ["bench", "--preset", "gpt2-small", "--seq", "8", "--repeats", "1",
                                        "--dtype", "fp8"], [r"--dtype fp8\b.*f32, bf16"], with_output=False)
    # bf16 weights with a tensor cut short: the file and the tensor named, whichever --dtype computes. 20 bytes off
    # the end take out_proj.bias (E bf16 values) whole and the end of out_proj.weight: the file ends in the weight,
    # the tensor named.
    bf16_bytes = pc.safetensors_bytes(fx.sd, dtype="BF16")
    assert 2 * fx.sd["out_proj.bias"].numel() < 20, "the cut must reach into out_proj.weight"
    r.case("weights_bf16_file_cut_short", weights_bf16_truncated, r, fx,
           fx.raw("bf16_cut.safetensors", bf16_bytes[:-20]), "tensor 'out_proj.weight'")

    def bias_past_end(h):  # the last tensor's span runs 8 bytes past the end of the file
        h["out_proj.bias"]["data_offsets"] = [o + 8 for o in h["out_proj.bias"]["data_offsets"]]
    r.case("weights_bf16_offsets_past_end", weights_bf16_truncated, r, fx,
           fx.st("bf16_past.safetensors", dtype="BF16", header_override=bias_past_end), "out_proj.bias")
    r.case("dtype_bf16_runs_f32_weights", dtype_bf16, r, fx, fx.weights)
    r.case("dtype_bf16_runs_bf16_weights", dtype_bf16, r, fx, fx.st("bf16.safetensors", dtype="BF16"))

    # --- integer options: checked against the range of the type they are stored in, never narrowed ---
    err("threads_beyond_int_range", fx.fwd(extra=["--threads", "4294967296"]),
        [r"--threads: must be in \[1, 1024\], got 4294967296"])
    err("threads_above_kMaxThreads", fx.fwd(extra=["--threads", "1025"]), [r"--threads: must be in \[1, 1024\]"])
    err("heads_beyond_int64", fx.fwd(drop=("--heads",), extra=["--heads", "99999999999999999999"]),
        [r"--heads: must be in \[1, 9223372036854775807\], got 99999999999999999999"])
    err("context_length_beyond_int64", fx.fwd(extra=["--context-length", "-99999999999999999999"]),
        [r"--context-length: must be in \[1, 9223372036854775807\]"])
    err("kv_heads_disagree_with_weights", fx.fwd(extra=["--kv-heads", "1"]),
        [r"K/V projections have \d+ outputs but the config asks for 1 K/V heads"])
    bench = ["bench", "--preset", "gpt2-small", "--seq", "4", "--json"]
    err("bench_repeats_beyond_int_range", bench + ["--repeats", "4294967296"],  # was 0 runs, then a SIGSEGV
        [r"--repeats: must be in \[1, 2147483647\], got 4294967296"], with_output=False)
    err("bench_threads_beyond_int_range", bench + ["--threads", "4294967296"],
        [r"--threads: must be in \[1, 1024\], got 4294967296"], with_output=False)
    err("bench_batch_beyond_int64", bench + ["--batch", "99999999999999999999"],
        [r"--batch: must be in \[1, 9223372036854775807\]"], with_output=False)
    err("bench_isa_unknown", bench + ["--isa", "sse9"], [r"--isa: unknown instruction set 'sse9'"], with_output=False)
    err("isa_unknown", fx.fwd(extra=["--isa", "avx"]), [r"--isa: unknown instruction set 'avx'"])
    err("bench_kv_heads_not_dividing_heads", bench + ["--kv-heads", "5"],
        [r"--kv-heads 5 does not divide gpt2-small's 12 heads"], with_output=False)
    err("bench_kv_dtype_unknown", bench + ["--mode", "decode", "--kv-dtype", "f16"],
        [r"--kv-dtype f16 is not supported \(supported: f32, bf16, int8, fp8\)"], with_output=False)
    err("bench_kv_dtype_without_decode", bench + ["--kv-dtype", "bf16"],
        [r"--kv-dtype applies to --mode decode and step only"], with_output=False)
    err("bench_kv_dtype_twice", bench + ["--mode", "decode", "--kv-dtype", "bf16", "--kv-dtype", "bf16"],
        [r"--kv-dtype bf16 given twice"], with_output=False)
    err("bench_kv_heads_twice", bench + ["--kv-heads", "4", "--kv-heads", "4"], [r"--kv-heads 4 given twice"],
        with_output=False)
    # Every repeatable option refuses a repeated value alike (a repeat would time and report a case twice).
    err("bench_preset_twice", bench + ["--preset", "gpt2-small"], [r"--preset gpt2-small given twice"],
        with_output=False)
    err("bench_dtype_twice", bench + ["--dtype", "bf16", "--dtype", "bf16"], [r"--dtype bf16 given twice"],
        with_output=False)
    err("bench_kv_heads_second_not_dividing", bench + ["--kv-heads", "4", "--kv-heads", "5"],
        [r"--kv-heads 5 does not divide gpt2-small's 12 heads"], with_output=False)
    # A single-valued option given twice was read as its last value; now it is refused.
    err("bench_batch_twice", bench + ["--batch", "2", "--batch", "3"], [r"--batch given more than once"],
        with_output=False)
    err("forward_threads_twice", fx.fwd(extra=["--threads", "1", "--threads", "2"]),
        [r"--threads given more than once"])
    err("bench_step_without_entries", bench + ["--mode", "step"],
        [r"--mode step needs at least one of --prefill, --decode, --draft"], with_output=False)
    err("bench_step_option_without_step", bench + ["--draft", "4x4"],
        [r"--draft applies to --mode step only"], with_output=False)
    err("bench_step_bad_pair", bench + ["--mode", "step", "--prefill", "16"],
        [r"--prefill 16: expected NxT, two counts from 1 to 1048576"], with_output=False)
    err("bench_step_zero_pair", bench + ["--mode", "step", "--draft", "4x0"],
        [r"--draft 4x0: expected NxT"], with_output=False)
    err("bench_step_with_batch", bench + ["--mode", "step", "--decode", "4", "--batch", "2"],
        [r"--batch does not apply to --mode step"], with_output=False)
    err("bench_interleave_without_decode", bench + ["--interleave"],
        [r"--interleave applies to --mode decode --cache cold only"], with_output=False)
    err("bench_interleave_warm", bench + ["--mode", "decode", "--interleave"],
        [r"--interleave applies to --mode decode --cache cold only"], with_output=False)
    r.case("bench_interleave_rows", bench_interleave_rows, r)
    r.case("bench_rows_say_what_ran", bench_rows_say_what_ran, r)
    r.case("bench_seq_sweep_and_config", bench_seq_sweep_and_config, r)
    err("bench_seq_twice", ["bench", "--preset", "gpt2-small", "--seq", "8", "--seq", "8"], ["--seq 8 given twice"],
        with_output=False)
    err("bench_config_missing", ["bench", "--config", fx.path("nope.json")], ["nope\\.json"], with_output=False)

    # --- bench sizes: products checked, and a case larger than physical memory refused before allocating ---
    err("bench_batch_times_seq_overflows", ["bench", "--batch", "280379743338241", "--seq", "257",
                                            "--preset", "gpt2-small"],
        [r"--batch 280379743338241 --seq 257.*overflow"], with_output=False)
    # Beyond this machine's memory by the input alone (d_in = 768 floats per token), at least 10M tokens.
    phys = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    big_t = max(10_000_000, phys // (768 * 4) + 1)
    for mode in ("prefill", "decode"):
        r.case("bench_%s_beyond_physical_memory" % mode, expect_fast, 5.0, expect_error, r,
               ["bench", "--seq", big_t, "--preset", "gpt2-small", "--mode", mode],
               [r"needs at least \d+ bytes.*physical memory"], with_output=False)

    # --- --output: links followed, special files refused and left as they were ---
    r.case("output_symlink_followed", output_symlink_followed, r, fx)
    r.case("output_same_file_as_an_input_refused", output_same_file_as_an_input_refused, r, fx)
    r.case("output_fifo_refused", output_special_refused, r, fx, "fifo", False)
    r.case("output_symlink_to_fifo_refused", output_special_refused, r, fx, "fifo", True)
    r.case("output_char_device_refused", output_special_refused, r, fx, "chr", False)
    r.case("output_dangling_symlink_refused", output_dangling_symlink_refused, r, fx)
    err("output_directory_refused", fx.fwd(), ["not a regular file"], output=fx.dir, output_exists=True)
    r.case("output_temporary_name_taken_by_a_link", output_temporary_name_taken, r, fx)
    r.case("output_keeps_the_mode_it_replaces", output_keeps_mode, r, fx)

    # --- inputs ---
    err("query_rank_4", fx.fwd(query=fx.npy("q4.npy", np.zeros((1, B, T, E), np.float32))),
        ["rank", "dim", "shape", "query"])
    err("query_rank_1", fx.fwd(query=fx.npy("q1.npy", np.zeros((E,), np.float32))), ["rank", "dim", "shape", "query"])
    err("query_width_not_d_in", fx.fwd(query=fx.npy("qw.npy", np.zeros((B, T, E + 1), np.float32))),
        ["width", "d_in", "query", "shape"])
    err("query_int32", fx.fwd(query=fx.npy("qi.npy", np.zeros((B, T, E), np.int32))),
        ["dtype", "float", "type", "query"])
    err("query_missing_file", fx.fwd(query=fx.path("missing_q.npy")),
        ["missing_q", "no such", "not found", "cannot open", "does not exist"])
    nan_q = np.zeros((B, T, E), np.float32)
    nan_q[1, 2, 3] = np.nan
    err("query_contains_nan", fx.fwd(query=fx.npy("qnan.npy", nan_q)), ["nan", "finite"])
    err("query_fortran_order", fx.fwd(query=fx.npy("qf.npy", np.asfortranarray(np.ones((B, T, E), np.float32)))),
        ["fortran", "order"])
    with open(fx.q, "rb") as f:
        qbytes = f.read()
    err("query_truncated_npy", fx.fwd(query=fx.raw("qtrunc.npy", qbytes[:-7])),
        ["truncat", "size", "short", "end", "bytes"])
    err("query_not_npy", fx.fwd(query=fx.raw("qjunk.npy", b"this is not an npy file at all")),
        ["npy", "magic", "format", "header"])
    err("key_without_value", fx.fwd(extra=["--key", fx.kv]), ["value"])
    err("value_without_key", fx.fwd(extra=["--value", fx.kv]), ["key"])
    err("key_value_lengths_differ", fx.fwd(extra=["--key", fx.kv, "--value",
                                                  fx.npy("v4.npy", np.zeros((B, 4, E), np.float32))]),
        ["key", "value", "length", "shape"])
    err("key_batch_differs", fx.fwd(extra=["--key", fx.npy("k3.npy", np.zeros((B + 1, 5, E), np.float32)),
                                           "--value", fx.npy("v3.npy", np.zeros((B + 1, 5, E), np.float32))]),
        ["batch", "key", "shape"])
    err("key_width_not_kdim", fx.fwd(extra=["--key", fx.npy("kw.npy", np.zeros((B, 5, E + 2), np.float32)),
                                            "--value", fx.kv]),
        ["kdim", "key", "width", "shape"])

    # --- masks ---
    err("mask_wrong_shape", fx.fwd(extra=["--mask", fx.npy("m_bad.npy", np.ones((T, T + 1), bool)),
                                          "--mask-kind", "block"]), ["mask"])
    err("mask_wrong_batch_rank3", fx.fwd(extra=["--mask", fx.npy("m_b.npy", np.ones((B + 1, T, T), bool)),
                                                "--mask-kind", "keep"]), ["mask"])
    err("mask_rank5", fx.fwd(extra=["--mask", fx.npy("m5.npy", np.ones((1, B, H, T, T), bool)),
                                    "--mask-kind", "keep"]), ["mask"])
    err("additive_mask_given_as_bool", fx.fwd(extra=["--mask", fx.npy("m_add.npy", np.zeros((T, T), bool)),
                                                     "--mask-kind", "additive"]),
        ["additive", "float", "bool", "mask"])
    err("key_padding_wrong_shape", fx.fwd(extra=["--key-padding", fx.npy("kp.npy", np.zeros((B, T + 1), bool))]),
        ["padding", "key"])
    # torch adds a float key_padding_mask; it was read as nonzero = padding, silently another answer than torch's.
    err("key_padding_float_refused",
        fx.fwd(extra=["--key-padding", fx.npy("kpf.npy", np.array([[0, 0.5, 0]] * B, np.float32))]),
        [r"--key-padding .*kpf\.npy: a float mask \(torch adds it"])

    # --- option values ---
    # `--output --causal` wrote a file named "--causal" and computed without the causal mask.
    r.case("option_as_value_refused", option_as_value_refused, r, fx)
    err("bench_check_and_no_check", ["bench", "--check", "--no-check", "--preset", "gpt2-small", "--seq", "4"],
        [r"--check and --no-check contradict"], with_output=False)

    # --- lengths ---
    err("T_exceeds_context_length", fx.fwd(extra=["--context-length", T - 1]), ["context"])
    err("Tk_exceeds_context_length", fx.fwd(extra=["--key", fx.kv, "--value", fx.kv, "--context-length", 4]),
        ["context"])

    # --- informational commands ---
    r.case("presets_lists_all", lambda: presets(r))
    r.case("help_exits_0", lambda: help_ok(r))
    r.case("version", lambda: version_ok(r))
    r.finish()


def expect_missing_output(r, fx):
    p = pc.run_cli(r.cli, fx.fwd())
    cmd = pc.fmt_cmd(r.cli, fx.fwd())
    check(p.returncode == 2, "exit %d, expected 2: %s; stderr: %r" % (p.returncode, cmd, p.stderr[-300:]))
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    check(len(lines) == 1 and "output" in lines[0].lower(), "expected one stderr line naming --output, got %r"
          % p.stderr[-300:])
    return "stderr: %s" % lines[0]


def expect_fast(seconds, fn, *args, **kwargs):
    """fn(*args, **kwargs), which must return within `seconds` (a refusal, not an attempt)."""
    t0 = time.monotonic()
    extra = fn(*args, **kwargs)
    elapsed = time.monotonic() - t0
    check(elapsed < seconds, "took %.1f s, expected a refusal within %.0f s" % (elapsed, seconds))
    return extra


def output_symlink_followed(r, fx):
    """--output through a link to an existing file in another directory: the data lands in the target, the
    link stays a link, and no temporary file is left in either directory."""
    wd = r.workdir()
    os.makedirs(os.path.join(wd, "real"))
    target = os.path.join(wd, "real", "y.npy")
    with open(target, "wb") as f:
        f.write(b"old contents")
    link = os.path.join(wd, "link.npy")
    os.symlink(os.path.join("real", "y.npy"), link)
    args = fx.fwd(extra=["--output", link])
    p = pc.run_cli(r.cli, args)
    check(p.returncode == 0, "exit %d: %s; stderr %r" % (p.returncode, pc.fmt_cmd(r.cli, args), p.stderr[-300:]))
    check(os.path.islink(link), "the link %s was replaced by a regular file" % link)
    check(os.readlink(link) == os.path.join("real", "y.npy"), "the link now points to %s" % os.readlink(link))
    y = np.load(target)
    check(y.shape == (B, T, E) and y.dtype == np.float32, "target holds %s %s" % (y.shape, y.dtype))
    left = sorted(os.listdir(wd)) + sorted(os.listdir(os.path.join(wd, "real")))
    check(left == ["link.npy", "real", "y.npy"], "files left behind: %s" % left)
    return None


def output_same_file_as_an_input_refused(r, fx):
    """--output naming an input file, by the same path, another spelling of it, a symbolic link or a hard link,
    for every input option: refused before any work (exit 2, one line naming both options), the input unchanged."""
    wd = r.workdir()
    g = np.random.default_rng(1)
    mask = fx.npy("mask.npy", np.zeros((T, T), dtype=bool))
    padding = fx.npy("kp.npy", np.zeros((B, T), dtype=bool))
    kv = fx.npy("kv_same.npy", g.standard_normal((B, 5, E)).astype(np.float32))
    q_link = os.path.join(wd, "q_link.npy")
    os.symlink(fx.q, q_link)
    q_hard = os.path.join(wd, "q_hard.npy")
    os.link(fx.q, q_hard)
    q_spelled = os.path.join(fx.dir, ".", "sub", "..", os.path.basename(fx.q))
    os.makedirs(os.path.join(fx.dir, "sub"), exist_ok=True)
    cases = [("query", fx.q, []), ("query", q_link, []), ("query", q_hard, []), ("query", q_spelled, []),
             ("weights", fx.weights, []), ("key", kv, ["--key", kv, "--value", fx.kv]),
             ("value", kv, ["--key", fx.kv, "--value", kv]), ("mask", mask, ["--mask", mask]),
             ("key-padding", padding, ["--key-padding", padding])]
    for option, out, extra in cases:
        path = out if option not in ("query", "weights") else (fx.q if option == "query" else fx.weights)
        with open(path, "rb") as f:
            before = f.read()
        expect_error(r, fx.fwd(extra=extra), [r"--output .* is the same file as --%s " % re.escape(option)],
                     output=out, output_exists=True)
        with open(path, "rb") as f:
            check(f.read() == before, "--output %s replaced --%s %s" % (out, option, path))
    return None


def grouped_state_dict(sd, kv_heads):
    """The fixture's torch state dict cut to `kv_heads` K/V heads (fused in_proj rows: E of Q, then K and V)."""
    kw = kv_heads * (E // H)
    out = dict(sd)
    w, b = sd["in_proj_weight"], sd["in_proj_bias"]
    out["in_proj_weight"] = torch.cat([w[:E], w[E:E + kw], w[2 * E:2 * E + kw]]).contiguous()
    out["in_proj_bias"] = torch.cat([b[:E], b[E:E + kw], b[2 * E:2 * E + kw]]).contiguous()
    return out


def option_as_value_refused(r, fx):
    """A value that is one of the command's options is a missing value, not a file named after the option."""
    wd = r.workdir()
    args = fx.fwd(extra=["--output", "--causal"])
    p = subprocess.run([r.cli] + args, capture_output=True, text=True, cwd=wd, timeout=pc.CLI_TIMEOUT_S)
    check(p.returncode == 2, "exit %d, expected 2; stderr %r" % (p.returncode, p.stderr[-300:]))
    check("--output needs a value, got the option --causal" in p.stderr, "stderr: %r" % p.stderr[-300:])
    check(os.listdir(wd) == [], "files written: %s" % os.listdir(wd))
    return "stderr: %s" % p.stderr.strip()


def output_temporary_name_taken(r, fx):
    """A symbolic link planted at the name of the output's temporary file (it was <output>.tmp.<pid>, opened with
    O_TRUNC and followed) is not followed: its target keeps its contents and --output gets the result."""
    wd = r.workdir()
    victim = os.path.join(wd, "victim.txt")
    with open(victim, "w") as f:
        f.write("not yours")
    out = os.path.join(wd, "y.npy")
    # exec keeps the shell's pid, so $$ is the CLI's: links at the old temporary name and at the first one tried now.
    script = 'ln -s "$1" "$2.tmp.$$" && ln -s "$1" "$2.tmp.$$.0" && exec "$3" "${@:4}"'
    args = [str(a) for a in fx.fwd(extra=["--output", out])]
    p = subprocess.run(["bash", "-c", script, "bash", victim, out, r.cli] + args, capture_output=True, text=True,
                       timeout=pc.CLI_TIMEOUT_S)
    check(p.returncode == 0, "exit %d; stderr %r" % (p.returncode, p.stderr[-300:]))
    with open(victim, "rb") as f:
        check(f.read() == b"not yours", "the planted link's target was overwritten")
    check(not os.path.islink(out) and np.load(out).shape == (B, T, E), "--output is not the result")
    links = [n for n in os.listdir(wd) if os.path.islink(os.path.join(wd, n))]
    check(len(links) == 2 and all(n.startswith("y.npy.tmp.") for n in links), "links: %s" % links)
    return None


def output_keeps_mode(r, fx):
    """Renaming a new file over --output gave it 0666 less the umask; it now keeps the mode of the file it replaces."""
    out = os.path.join(r.workdir(), "y.npy")
    with open(out, "wb") as f:
        f.write(b"old")
    os.chmod(out, 0o600)
    p = pc.run_cli(r.cli, fx.fwd(extra=["--output", out]))
    check(p.returncode == 0, "exit %d; stderr %r" % (p.returncode, p.stderr[-300:]))
    mode = stat.S_IMODE(os.stat(out).st_mode)
    check(mode == 0o600 and np.load(out).shape == (B, T, E), "mode %o after the write" % mode)
    return None


def make_special(path, kind):
    """A FIFO, or a character device with /dev/null's numbers (made in the case's directory, so /dev is never
    at risk); None when this system does not allow making one."""
    try:
        if kind == "fifo":
            os.mkfifo(path)
        else:
            os.mknod(path, 0o600 | stat.S_IFCHR, os.makedev(1, 3))
    except (OSError, AttributeError):
        return None
    return path


def output_special_refused(r, fx, kind, via_link):
    """--output naming a FIFO or a character device (or a link to one): exit 2 naming --output, and the
    special file is left as it was (the atomic rename used to replace it with a regular file)."""
    wd = r.workdir()
    special = make_special(os.path.join(wd, kind), kind)
    if special is None:
        return "skipped: cannot make a %s here" % kind
    is_kind = stat.S_ISFIFO if kind == "fifo" else stat.S_ISCHR
    out = special
    if via_link:
        out = os.path.join(wd, "link.npy")
        os.symlink(kind, out)
    msg = expect_error(r, fx.fwd(), [r"--output .*not a regular file"], output=out, output_exists=True)
    check(is_kind(os.lstat(special).st_mode), "%s is no longer a %s" % (special, kind))
    check(not via_link or os.path.islink(out), "the link %s was replaced" % out)
    expected = sorted([kind] + (["link.npy"] if via_link else []))
    check(sorted(os.listdir(wd)) == expected, "files left behind: %s" % sorted(os.listdir(wd)))
    return msg


def output_dangling_symlink_refused(r, fx):
    """--output through a link to a missing file: refused, and neither the link nor its target changes."""
    wd = r.workdir()
    link = os.path.join(wd, "link.npy")
    os.symlink("missing.npy", link)
    msg = expect_error(r, fx.fwd(), [r"--output .*symbolic link"], output=link, output_exists=True)
    check(os.path.islink(link), "the link %s was replaced" % link)
    check(sorted(os.listdir(wd)) == ["link.npy"], "files left behind: %s" % sorted(os.listdir(wd)))
    return msg


def bench_interleave_rows(r):
    """decode --interleave over two K/V dtypes and two K/V head counts: exit 0, one checked row per case in the
    order given (each --kv-dtype, each --kv-heads within it), each with x_first, the first case's exactly 1."""
    args = ["bench", "--preset", "gpt2-small", "--mode", "decode", "--cache", "cold", "--interleave", "--json",
            "--check", "--batch", "2", "--seq", "8", "--repeats", "3", "--threads", "1",
            "--kv-dtype", "f32", "--kv-dtype", "int8", "--kv-heads", "12", "--kv-heads", "4"]
    p = pc.run_cli(r.cli, args)
    cmd = pc.fmt_cmd(r.cli, args)
    check(p.returncode == 0, "exit %d, expected 0: %s; stderr: %r" % (p.returncode, cmd, p.stderr[-300:]))
    rows = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
    got = [(row["kv_dtype"], row["kv_heads"]) for row in rows]
    want = [("f32", 12), ("f32", 4), ("int8", 12), ("int8", 4)]
    check(got == want, "rows %s, expected %s (%s)" % (got, want, cmd))
    check(all(row["check"] == "ok" for row in rows), "a row failed its check: %s" % rows)
    check(rows[0]["x_first"] == 1.0, "the first case's x_first is %r, expected 1" % rows[0]["x_first"])
    check(all(row["x_first"] > 0 for row in rows), "x_first not positive: %s" % [row["x_first"] for row in rows])
    return "x_first %s" % ", ".join("%.2f" % row["x_first"] for row in rows)


def bench_rows_say_what_ran(r):
    """Every bench row names the CPU, version, commit and time, and carries the spread of its repeats and whether the
    machine was busy; a cold decode's peak memory is its own, without the 256 MiB flush buffer; the table prints the
    tolerance's bound beside the error."""
    args = ["bench", "--preset", "gpt2-small", "--mode", "decode", "--cache", "cold", "--json", "--check",
            "--batch", "1", "--seq", "8", "--repeats", "3", "--threads", "1"]
    p = pc.run_cli(r.cli, args)
    cmd = pc.fmt_cmd(r.cli, args)
    check(p.returncode == 0, "exit %d, expected 0: %s; stderr: %r" % (p.returncode, cmd, p.stderr[-300:]))
    row = json.loads(p.stdout.splitlines()[0])
    for key in ("cpu", "version", "commit", "timestamp", "isa", "threads", "min_ms", "median_ms", "max_ms",
                "repeats", "busy", "waited_share", "allowed_abs_err"):
        check(key in row, "row lacks %r: %s" % (key, row))
    check(row["cpu"] and row["version"] and re.fullmatch(r"[0-9a-f]{7,40}|unknown", row["commit"]),
          "cpu, version or commit empty or malformed: %s" % row)
    check(re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", row["timestamp"]), "timestamp %r" % row["timestamp"])
    check(row["repeats"] == 3 and row["min_ms"] <= row["median_ms"] <= row["max_ms"], "spread %s" % row)
    check(isinstance(row["busy"], bool) and row["waited_share"] >= 0, "busy %r" % row["busy"])
    warm_args = [a for a in args if a not in ("--cache", "cold")]
    warm = pc.run_cli(r.cli, warm_args)
    check(warm.returncode == 0, "exit %d: %s" % (warm.returncode, pc.fmt_cmd(r.cli, warm_args)))
    warm_mb = json.loads(warm.stdout.splitlines()[0])["peak_rss_mb"]
    check(0 < row["peak_rss_mb"] < warm_mb + 128, "a cold gpt2-small decode of 8 tokens peaked at %.0f MB against "
          "%.0f MB warm: the 256 MiB flush buffer counted" % (row["peak_rss_mb"], warm_mb))
    check(row["max_abs_err"] <= row["allowed_abs_err"], "error over its bound: %s" % row)
    table = pc.run_cli(r.cli, ["bench", "--preset", "gpt2-small", "--seq", "8", "--repeats", "3", "--threads", "1"])
    line = [ln for ln in table.stdout.splitlines() if ln.startswith("gpt2-small")][0]
    check(re.search(r"\d\.\d\de-\d\d \(\d\.\de-\d\d\) ok$", line), "the table row does not show the bound: %r" % line)
    return "%s, commit %s, peak %.0f MB cold, %.0f MB warm" % (row["cpu"], row["commit"], row["peak_rss_mb"], warm_mb)


def bench_seq_sweep_and_config(r):
    """--seq repeated sweeps T, and --config benchmarks the layer a config file describes (named by its path) after
    the presets named."""
    config = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "configs", "gpt3-medium.json")
    args = ["bench", "--preset", "gpt2-small", "--config", config, "--seq", "8", "--seq", "16", "--repeats", "1",
            "--threads", "1", "--json", "--no-check"]
    p = pc.run_cli(r.cli, args)
    cmd = pc.fmt_cmd(r.cli, args)
    check(p.returncode == 0, "exit %d, expected 0: %s; stderr: %r" % (p.returncode, cmd, p.stderr[-300:]))
    rows = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
    got = [(row["preset"], row["seq"], row["kv_heads"]) for row in rows]
    want = [("gpt2-small", 8, 12), ("gpt2-small", 16, 12), (config, 8, 16), (config, 16, 16)]
    check(got == want, "rows %s, expected %s (%s)" % (got, want, cmd))
    return "%d rows" % len(rows)


def gpt2_layout_is_causal(r, fx):
    """Weights in GPT-2's Conv1D layout run causal without --config or --causal (GPT-2's attention is), and
    --no-causal drops the mask; torch's naming keeps the flag's meaning."""
    wd = r.workdir()
    gpt2 = pc.write_safetensors(os.path.join(wd, "gpt2.safetensors"), pc.hf_gpt2_layout(fx.sd))

    def run(name, weights, extra):
        out = os.path.join(wd, name + ".npy")
        args = fx.fwd(weights=weights, extra=list(extra) + ["--output", out])
        p = pc.run_cli(r.cli, args)
        check(p.returncode == 0, "exit %d: %s; stderr: %r" % (p.returncode, pc.fmt_cmd(r.cli, args), p.stderr[-300:]))
        return np.load(out, allow_pickle=False)

    causal, plain = run("torch_causal", fx.weights, ["--causal"]), run("torch_plain", fx.weights, [])
    check(not np.array_equal(causal, plain), "the causal and non-causal outputs are equal: the case shows nothing")
    check(np.allclose(run("gpt2", gpt2, []), causal, rtol=1e-5, atol=1e-6),
          "GPT-2 Conv1D weights without --causal did not give the causal output")
    check(np.allclose(run("gpt2_no_causal", gpt2, ["--no-causal"]), plain, rtol=1e-5, atol=1e-6),
          "--no-causal over GPT-2 Conv1D weights did not give the non-causal output")
    return "GPT-2 layout: causal by default, --no-causal drops the mask"


def config_causal_applies(r, fx, ours_causal, hf_gpt2):
    """A config file that says causal (ours with causal: true, and any Hugging Face GPT-2 config: GPT-2 is causal)
    gives the --causal output, which differs from the non-causal one."""
    wd = r.workdir()

    def run(name, extra, drop=()):
        out = os.path.join(wd, name + ".npy")
        args = fx.fwd(extra=list(extra) + ["--output", out], drop=drop)
        p = pc.run_cli(r.cli, args)
        check(p.returncode == 0, "exit %d: %s; stderr: %r" % (p.returncode, pc.fmt_cmd(r.cli, args), p.stderr[-300:]))
        return np.load(out, allow_pickle=False)

    flag = run("flag", ["--causal"])
    plain = run("plain", [])
    check(not np.array_equal(flag, plain), "the causal and non-causal outputs are equal: the case shows nothing")
    for name, path in (("ours", ours_causal), ("hf", hf_gpt2)):
        y = run(name, ["--config", path], drop=("--heads",))
        check(np.array_equal(y, flag), "--config %s (%s) did not give the --causal output" % (path, name))
    return "both configs gave the --causal output"


def dtype_bf16(r, fx, weights):
    """--dtype bf16 runs: exit 0, nothing on stderr, a finite float32 (B, T, E) output."""
    wd = r.workdir()
    out = os.path.join(wd, "y.npy")
    args = fx.fwd(weights=weights, extra=["--dtype", "bf16", "--output", out])
    p = pc.run_cli(r.cli, args)
    cmd = pc.fmt_cmd(r.cli, args)
    check(p.returncode == 0, "exit %d, expected 0: %s; stderr: %r" % (p.returncode, cmd, p.stderr[-300:]))
    check(p.stderr.strip() == "", "stderr not empty: %r (%s)" % (p.stderr[-300:], cmd))
    check(os.path.exists(out), "exit 0 but no output file: %s" % cmd)
    y = np.load(out, allow_pickle=False)
    check(y.shape == (B, T, E) and y.dtype == np.float32, "bf16 output %s %s, expected %s float32"
          % (y.shape, y.dtype, (B, T, E)))
    check(np.all(np.isfinite(y)), "bf16 output has %d non-finite elements" % int(np.sum(~np.isfinite(y))))
    return "max |y| %.3g" % float(np.max(np.abs(y)))


def weights_bf16_truncated(r, fx, weights, tensor):
    """A BF16 weights file whose `tensor` runs past the end of the file: the bad-input contract, under --dtype
    bf16 and f32 alike, with one line naming the file and the tensor."""
    notes = []
    for dtype in ("bf16", "f32"):
        msg = expect_error(r, fx.fwd(weights=weights, extra=["--dtype", dtype]), [re.escape(os.path.basename(weights))])
        check(tensor in msg, "stderr does not name the tensor %s: %r" % (tensor, msg))
        notes.append(msg)
    check(notes[0] == notes[1], "--dtype bf16 and f32 say different things: %r vs %r" % tuple(notes))
    return notes[0]


def presets(r):
    p = pc.run_cli(r.cli, ["presets"])
    check(p.returncode == 0, "`gpt2attn presets` exit %d; stderr %r" % (p.returncode, p.stderr[-300:]))
    names = ["gpt2-small", "gpt2-medium", "gpt2-large", "gpt2-xl", "gpt3-small", "gpt3-medium", "gpt3-large",
             "gpt3-xl", "gpt3-2.7b", "gpt3-6.7b", "gpt3-13b", "gpt3-175b"]
    missing = [n for n in names if not re.search(r"(^|[^\w.-])%s($|[^\w.-])" % re.escape(n), p.stdout)]
    check(not missing, "presets output lacks %s: %r" % (missing, p.stdout[:400]))
    return "%d presets" % len(names)


def help_ok(r):
    p = pc.run_cli(r.cli, ["--help"])
    check(p.returncode == 0, "`gpt2attn --help` exit %d; stderr %r" % (p.returncode, p.stderr[-300:]))
    text = p.stdout + p.stderr
    check("forward" in text, "--help does not mention the forward command: %r" % text[:300])
    return None


def version_ok(r):
    p = pc.run_cli(r.cli, ["--version"])
    check(p.returncode == 0, "`gpt2attn --version` exit %d; stderr %r" % (p.returncode, p.stderr[-300:]))
    check(re.fullmatch(r"gpt2attn \d+\.\d+\.\d+\n", p.stdout) is not None, "--version printed %r" % p.stdout)
    return p.stdout.strip()


if __name__ == "__main__":
    main()
