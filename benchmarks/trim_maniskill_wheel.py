"""Rebuilds the mani_skill wheel with only the data files that the Panda table-top tasks load.

The full wheel (~102 MB) is too large to travel to the GPU machine next to SAPIEN in one ``carry``. Every
Python file is kept (``mani_skill.envs`` imports every task module); of the data files only these stay:

* the Panda robot (``assets/robots/panda``: its URDF/SRDF files and ``franka_description``; with
  ``--wristcam`` also the RealSense mesh that ``panda_v3.urdf`` (``robot_uids="panda_wristcam"``) names);
* the table scene (``utils/scene_builder/table``) and the floor/grid textures (``utils/building/assets``);
* every data file under 64 KiB (metadata JSON read at import, READMEs).

Dropped: the other robots, ``assets/environment_maps`` (only ray-traced shaders read them; the tasks render
with SAPIEN's default rasteriser), the ReplicaCAD / AI2-THOR / RoboCasa / kitchen scene data and
``assets/maniskill2-scene-2.glb``. The ``RECORD`` is rewritten for the kept files.

    python3 benchmarks/trim_maniskill_wheel.py mani_skill-3.0.1-py3-none-any.whl -o OUTDIR
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import zipfile
from pathlib import Path

KEEP_PREFIXES = (
    "mani_skill/assets/robots/panda/franka_description/",
    "mani_skill/utils/scene_builder/table/",
    "mani_skill/utils/building/assets/",
    "mani_skill/assets/partnet_mobility/meta/",
)
"""Data folders kept whole."""
WRISTCAM_FILES = ("mani_skill/assets/robots/panda/realsense2_description/meshes/d415.stl",)
"""The wrist camera's mesh (panda_v3.urdf), kept with ``--wristcam``."""
CODE_SUFFIXES = (".py", ".pyi", ".typed")
SMALL_BYTES = 64 * 1024
"""Data files below this size are kept wherever they are."""


def keep(name: str, size: int, *, wristcam: bool = False) -> bool:
    """Whether the wheel member `name` (of `size` bytes) stays in the trimmed wheel.

    Example:
        >>> keep("mani_skill/envs/tasks/tabletop/pick_cube.py", 9000)
        True
        >>> keep("mani_skill/assets/environment_maps/default.hdr", 33_000_000)
        False
    """
    if not name.startswith("mani_skill/") or name.endswith(CODE_SUFFIXES) or size < SMALL_BYTES:
        return True
    if name.startswith("mani_skill/assets/robots/panda/") and name.count("/") == 4:
        return name.endswith((".urdf", ".srdf"))  # the Panda variants' own description files
    return name.startswith(KEEP_PREFIXES) or (wristcam and name in WRISTCAM_FILES)


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def trim(wheel: Path, out_dir: Path, *, wristcam: bool = False) -> Path:
    """Writes the trimmed copy of `wheel` (same file name) into `out_dir` and returns its path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / wheel.name
    if target.resolve() == wheel.resolve():
        raise ValueError(f"trim: --out must differ from the wheel's folder, got {out_dir}")
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED) as dst:
        members = src.infolist()
        record = next(m.filename for m in members if m.filename.endswith(".dist-info/RECORD"))
        lines = []
        for info in members:
            if info.filename == record or info.is_dir() or not keep(info.filename, info.file_size, wristcam=wristcam):
                continue
            data = src.read(info)
            dst.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED)
            lines.append(_record_line(info.filename, data))
        lines.append(f"{record},,")
        dst.writestr(record, "\n".join(lines) + "\n")
    return target


def main(argv: list[str] | None = None) -> None:
    """Command line: the wheel, the output folder, ``--wristcam``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("wheel", type=Path, help="the mani_skill wheel")
    parser.add_argument("-o", "--out", type=Path, required=True, help="folder for the trimmed wheel")
    parser.add_argument("--wristcam", action="store_true", help="keep the wrist camera mesh (panda_wristcam)")
    args = parser.parse_args(argv)
    target = trim(args.wheel, args.out, wristcam=args.wristcam)
    print(f"{target}: {target.stat().st_size / 2**20:.1f} MiB (from {args.wheel.stat().st_size / 2**20:.1f} MiB)")


if __name__ == "__main__":
    main()
