"""`disagg make-checkpoint`: write an embedded checkpoint folder from the shell.

    disagg make-checkpoint --arch nemotron_h --size small --seed 1 ./ckpt
    disagg make-checkpoint --arch nemotron_h --mtp ./ckpt-mtp   # with MTP layers

Errors the user can fix (a path that is a file, a folder that cannot be
written, a bad value) print one line on stderr and exit with status 1.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from models.embedded.configs import (
    ARCHS,
    DEFAULT_INITIALIZER_RANGE,
    DEFAULT_VL_ARCHITECTURE,
    IMAGE_FORMATS,
    MTP_ARCHS,
    MTP_PATTERN,
    SIZES,
    VL_ARCHITECTURES,
)

EXIT_USAGE_ERROR = 1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the make-checkpoint options on `parser`."""
    parser.add_argument("--arch", required=True, choices=ARCHS, help="model family")
    parser.add_argument(
        "--size",
        default="tiny",
        choices=SIZES,
        help="tiny: fast tests (hidden 64); small: compute-bound decode on CPU (hidden 512); "
        "mini: the served benchmark's model (hidden 256, 4 layers)",
    )
    parser.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    parser.add_argument(
        "--vl-architecture",
        choices=VL_ARCHITECTURES,
        default=None,
        help=f"wrapper class name for --arch nemotron_vl (default {DEFAULT_VL_ARCHITECTURE})",
    )
    parser.add_argument(
        "--image-format",
        choices=IMAGE_FORMATS,
        default=None,
        help="image preprocessing of --arch nemotron_vl: dynamic (transformers' Omni "
        "dynamic resolution, default) or tiles (the VL V2 tiles plus thumbnail)",
    )
    parser.add_argument(
        "--mtp",
        action="store_true",
        help="--arch nemotron_h / nemotron_vl: add one multi-token-prediction step "
        f"(num_nextn_predict_layers 1, mtp_hybrid_override_pattern {MTP_PATTERN!r}) "
        "and its mtp.layers.* tensors",
    )
    parser.add_argument(
        "--hybrid-pattern",
        default=None,
        metavar="PATTERN",
        help="--arch nemotron_h / nemotron_vl: the layers, one character each (M Mamba2, "
        "* attention, - MLP, E MoE) instead of the size's; e.g. M-M*-M-M*-M for a hybrid "
        "without MoE, which vLLM's CPU build can run",
    )
    parser.add_argument(
        "--initializer-range",
        type=float,
        default=None,
        help=f"std of the random weights (default {DEFAULT_INITIALIZER_RANGE})",
    )
    parser.add_argument("out", type=Path, help="output folder (created if missing)")


def run(args: argparse.Namespace) -> int:
    """Write the checkpoint; return 0, or 1 after one stderr line on a user error."""
    from models.embedded.configs import UnknownCheckpointKindError
    from models.embedded.writer import CheckpointWriteError, write_checkpoint

    for option, value in (
        ("--vl-architecture", args.vl_architecture),
        ("--image-format", args.image_format),
    ):
        if value is not None and args.arch != "nemotron_vl":
            return _fail(f"{option} applies to --arch nemotron_vl only; drop it")
    if args.mtp and args.arch not in MTP_ARCHS:
        return _fail(f"--mtp applies to --arch {' and '.join(MTP_ARCHS)} only; drop it")
    started = time.monotonic()
    try:
        out = write_checkpoint(
            args.out,
            args.arch,
            size=args.size,
            seed=args.seed,
            vl_architecture=args.vl_architecture,
            initializer_range=args.initializer_range,
            progress=args.size != "tiny",
            image_format=args.image_format,
            mtp=args.mtp,
            hybrid_pattern=args.hybrid_pattern,
        )
    except (CheckpointWriteError, UnknownCheckpointKindError) as error:
        return _fail(str(error))
    except ValueError as error:
        return _fail(f"invalid argument: {error}")
    except OSError as error:
        return _fail(f"cannot write checkpoint into {args.out}: {error.strerror or error}")
    elapsed = time.monotonic() - started
    layers = " with MTP layers" if args.mtp else ""
    print(
        f"wrote {args.arch} ({args.size}, seed {args.seed}) checkpoint{layers} to {out} "
        f"in {elapsed:.1f}s"
    )
    return 0


def _fail(message: str) -> int:
    print(f"disagg make-checkpoint: error: {message}", file=sys.stderr)
    return EXIT_USAGE_ERROR
