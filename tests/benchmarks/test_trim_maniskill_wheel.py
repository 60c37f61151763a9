"""What the trimmed mani_skill wheel keeps (benchmarks/trim_maniskill_wheel.py) and that it is a valid wheel."""

import zipfile

from benchmarks.trim_maniskill_wheel import keep, trim

BIG = 10 * 2**20


def test_keeps_code_panda_and_table_drops_other_data():
    assert keep("mani_skill/envs/tasks/tabletop/pick_cube.py", BIG)
    assert keep("mani_skill/assets/robots/panda/panda_v2.urdf", BIG)
    assert keep("mani_skill/assets/robots/panda/franka_description/meshes/visual/link0.glb", BIG)
    assert keep("mani_skill/utils/scene_builder/table/assets/table.glb", BIG)
    assert keep("mani_skill/utils/scene_builder/replicacad/metadata.json", 1000)  # small data stays
    assert not keep("mani_skill/assets/environment_maps/default.hdr", BIG)
    assert not keep("mani_skill/assets/robots/fetch/fetch.urdf.glb", BIG)
    assert not keep("mani_skill/utils/scene_builder/replicacad/assets/scene.glb", BIG)
    wristcam = "mani_skill/assets/robots/panda/realsense2_description/meshes/d415.stl"
    assert not keep(wristcam, BIG) and keep(wristcam, BIG, wristcam=True)


def test_trim_rewrites_the_record(tmp_path):
    wheel = tmp_path / "in" / "mani_skill-3.0.1-py3-none-any.whl"
    wheel.parent.mkdir()
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("mani_skill/__init__.py", "x = 1\n")
        z.writestr("mani_skill/assets/environment_maps/default.hdr", b"\0" * BIG)
        z.writestr("mani_skill-3.0.1.dist-info/METADATA", "Name: mani_skill\n")
        z.writestr("mani_skill-3.0.1.dist-info/RECORD", "stale\n")
    out = trim(wheel, tmp_path / "out")
    with zipfile.ZipFile(out) as z:
        names = set(z.namelist())
        record = z.read("mani_skill-3.0.1.dist-info/RECORD").decode().splitlines()
    assert names == {
        "mani_skill/__init__.py",
        "mani_skill-3.0.1.dist-info/METADATA",
        "mani_skill-3.0.1.dist-info/RECORD",
    }
    assert [line.split(",")[0] for line in record] == [
        "mani_skill/__init__.py",
        "mani_skill-3.0.1.dist-info/METADATA",
        "mani_skill-3.0.1.dist-info/RECORD",
    ]
    assert record[0].endswith(",6") and "sha256=" in record[0]
