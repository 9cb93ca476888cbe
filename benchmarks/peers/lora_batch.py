"""Run llama.cpp's convert_lora_to_gguf.py over many adapters in one process (convert.py starts it
with the converters' python; standard library only):

    python lora_batch.py CONVERT_LORA_TO_GGUF.py BASE_DIR < [[out.gguf, adapter_dir], ...]

Each adapter is the script run as `__main__` (runpy) with the arguments one process per adapter
would get; its imports (torch, transformers: ~5 s) happen once, so 1,000 adapters take minutes, not
an hour and a half, and the files are byte for byte those of one process each. Written to a .part
name, then renamed; each name finished is printed to stdout (the script's own output goes to stderr).
"""

import json
import os
import runpy
import sys


def main() -> None:
    script, base = sys.argv[1], sys.argv[2]
    done = os.fdopen(os.dup(1), "w")  # progress on the real stdout ...
    os.dup2(2, 1)  # ... anything the converter prints, to stderr (the log)
    sys.path.insert(0, os.path.dirname(script))  # its sibling modules, as when run directly
    for out, adapter in json.load(sys.stdin):
        tmp = out + ".part"
        sys.argv = [script, "--base", base, "--outtype", "f32", "--outfile", tmp, adapter]
        try:
            runpy.run_path(script, run_name="__main__")
        except SystemExit as e:  # the script's own exit on a bad adapter
            if e.code not in (None, 0):
                raise
        os.replace(tmp, out)
        print(os.path.basename(out), file=done, flush=True)


if __name__ == "__main__":
    main()
