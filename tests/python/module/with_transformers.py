#!/usr/bin/python3
"""ctest python.hf_transformers: test_torch_hf.py and test_gpt2_checkpoint.py under a venv that has Hugging Face
transformers.

    with_transformers.py --venv DIR [pytest arguments...]

The venv (kept in DIR between runs) sees the system's site-packages (Debian's torch and numpy) and gets a
transformers release that supports torch 1.13 from the package index; without the index the test is skipped (exit
77, the reason printed)."""
import os
import subprocess
import sys

TRANSFORMERS = "transformers==4.40.2"  # a release whose GPT-2 runs on Debian's torch 1.13
SKIP = 77


def main():
    venv, pytest_args = sys.argv[2], sys.argv[3:]
    python = os.path.join(venv, "bin", "python")
    if not os.path.exists(python):
        subprocess.run(["/usr/bin/python3", "-m", "venv", "--system-site-packages", venv], check=True)
    pip = [python, "-m", "pip", "--disable-pip-version-check", "-q"]
    if subprocess.run([python, "-c", "import transformers"], capture_output=True).returncode != 0:
        probe = subprocess.run(pip + ["download", "--no-deps", "-d", os.path.join(venv, "probe"), TRANSFORMERS],
                               capture_output=True, text=True, timeout=300)
        if probe.returncode != 0:
            print(f"SKIP: pip cannot fetch {TRANSFORMERS} from the package index:\n{probe.stderr[-1500:]}")
            return SKIP
        subprocess.run(pip + ["install", TRANSFORMERS], check=True)
    return subprocess.run([python, "-m", "pytest", "-q", "-p", "no:cacheprovider"] + pytest_args).returncode


if __name__ == "__main__":
    sys.exit(main())
