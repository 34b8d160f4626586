#!/usr/bin/python3
"""The engine's layers, and a check that no file includes a header of a layer above its own.

    tools/check-layers.py [REPO_ROOT]

    common  ->  storage, formats, kernels, model  ->  optim  ->  runtime  ->  tools

A file may include headers of its own layer and of the layers below it (docs/architecture.md
draws the same picture). Files under src/, kernels/ and tools/ belong to the layer of their
directory; a public header (include/fuyou/NAME.h) to the layer PUBLIC gives it, the one list
of where each public header sits. Tools include public headers only: an internal header
(src/..., kernels/...) included from tools/ is refused too. Exit status 1 on any violation,
each printed as FILE:LINE, the include and the two layers; also 1 for a public header missing
from PUBLIC, so a new header is placed when it is written.
"""
import os
import re
import sys

LEVELS = {"common": 0, "storage": 1, "formats": 1, "kernels": 1, "model": 1, "optim": 2,
          "runtime": 3, "tools": 4}

# Where each public header sits: the layer whose code implements it.
PUBLIC = {
    "error": "common", "sizes": "common", "log": "common", "read_file": "common",
    "threads": "common", "rng": "common", "elem_type": "common", "timing": "common", "tier": "common", "rope": "common",
    "storage": "storage", "io_bench": "storage",
    "config": "formats", "data": "formats", "tokenizer": "formats", "safetensors": "formats",
    "hf_checkpoint": "formats", "partial_outputs": "formats", "hardware": "formats",
    "device_costs": "kernels",
    "backend": "kernels", "cuda": "kernels",
    "model": "model", "lora": "model", "peft_adapter": "formats", "decoder": "model", "op_class": "model", "family": "model",
    "optim": "optim", "ooc_adamw": "optim", "adam_bench": "optim", "loss_scale": "optim", "train_state": "optim",
    "backend_select": "runtime", "breakdown": "runtime", "checkpoint_bench": "runtime",
    "sim_bench": "runtime", "checkpoint": "runtime", "engine": "runtime", "lora_step": "runtime",
    "generate": "runtime", "plan": "runtime", "scheduler": "runtime", "simulator": "runtime",
    "swap_search": "runtime", "train": "runtime", "resource": "runtime",
    "step_result": "runtime", "stop": "runtime", "curves": "runtime",
}

INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"')
SOURCE = (".h", ".cc", ".cu", ".cuh", ".in")


def layer_of_path(rel):
    """The layer of a repository file, or None for files outside the layers (tests, fuzz)."""
    parts = rel.split("/")
    if parts[0] == "src" and len(parts) > 2:
        return parts[1] if parts[1] in LEVELS else None
    if parts[0] == "kernels":
        return "kernels"
    if parts[0] == "tools":
        return "tools"
    if parts[0] == "include" and len(parts) == 3 and parts[1] == "fuyou":
        return PUBLIC.get(os.path.splitext(parts[2])[0], "?")
    return None


def layer_of_include(inc, including_dir):
    """The layer of an included header, by its path from the repository root (or beside the
    including file); None for third-party headers."""
    if inc.startswith("fuyou/"):
        return PUBLIC.get(os.path.splitext(inc[len("fuyou/"):])[0], "?")
    for rel in (inc, os.path.normpath(os.path.join(including_dir, inc))):
        layer = layer_of_path(rel)
        if layer is not None:
            return layer
    return None


def main():
    root = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else
                           os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    errors = []
    for name in sorted(os.listdir(os.path.join(root, "include", "fuyou"))):
        if name.endswith(".h") and name[:-2] not in PUBLIC:
            errors.append("include/fuyou/%s: a public header without a layer: add it to PUBLIC "
                          "in tools/check-layers.py" % name)
    checked = 0
    for top in ("src", "kernels", "tools", "include"):
        for dirpath, _, files in os.walk(os.path.join(root, top)):
            for f in sorted(files):
                if not f.endswith(SOURCE):
                    continue
                path = os.path.join(dirpath, f)
                rel = os.path.relpath(path, root)
                own = layer_of_path(rel)
                if own is None or own == "?":
                    continue
                checked += 1
                with open(path, encoding="utf-8", errors="replace") as src:
                    for n, line in enumerate(src, 1):
                        m = INCLUDE.match(line)
                        if not m:
                            continue
                        inc = m.group(1)
                        theirs = layer_of_include(inc, os.path.dirname(rel))
                        if theirs is None or theirs == "?":
                            continue
                        if LEVELS[theirs] > LEVELS[own]:
                            errors.append("%s:%d: includes %s: %s sits above %s" % (rel, n, inc, theirs, own))
                        elif own == "tools" and not inc.startswith("fuyou/") and not inc.startswith("tools/"):
                            errors.append("%s:%d: includes %s: tools use public headers (include/fuyou/) "
                                          "only" % (rel, n, inc))
    for e in errors:
        print(e)
    print("%d files checked, %d violation(s)" % (checked, len(errors)))
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
