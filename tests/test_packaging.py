"""Packaging: what the wheel, the sdist and the frozen app carry, checked without building anything.

The wheel's contents are computed with setuptools' own ``build_py`` command over pyproject.toml,
which is what ``python -m build`` runs; the frozen app's data list comes from packaging/bundle_data.py,
which packaging/specplay.spec uses.
"""

from __future__ import annotations

import configparser
import importlib.resources
import os
import struct
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGING = ROOT / "packaging"
ICONS = ROOT / "assets" / "icons"
ICON_SIZES = (16, 22, 24, 32, 48, 64, 128, 256, 512)
# Kinds of files under assets/ that must ship; a new kind has to be added to package-data first.
SHIPPED_SUFFIXES = {".jsonl", ".json", ".safetensors", ".png", ".svg"}

sys.path.insert(0, str(PACKAGING))
import bundle_data  # noqa: E402


def _assets_on_disk() -> set[Path]:
    return {p for p in (ROOT / "assets").rglob("*") if p.is_file() and p.suffix in SHIPPED_SUFFIXES
            and "__pycache__" not in p.parts}


@pytest.fixture(scope="module")
def setuptools_dist():
    """The setuptools Distribution that ``python -m build`` would configure from pyproject.toml."""
    from setuptools.dist import Distribution

    cwd = os.getcwd()
    os.chdir(ROOT)  # setuptools resolves package folders relative to the project root
    try:
        dist = Distribution()
        dist.parse_config_files(["pyproject.toml"])
        # package-data alone (the manifest route would run egg_info and write into the checkout):
        # the wheel must carry the assets through package-data, whatever MANIFEST.in says.
        dist.include_package_data = False
        build_py = dist.get_command_obj("build_py")
        build_py.ensure_finalized()
        data = {package: [Path(src_dir, f).resolve() for f in files]
                for package, src_dir, _build_dir, files in build_py.data_files}
    finally:
        os.chdir(cwd)
    return dist, data


def test_packages_in_the_wheel(setuptools_dist):
    dist, _ = setuptools_dist
    packages = set(dist.packages)
    # one installed namespace: nothing but specplay.* at the top of a user's environment
    assert {p.split(".")[0] for p in packages} == {"specplay"}
    assert {"specplay.app", "specplay.core", "specplay.core.models", "specplay.assets"} <= packages
    # the list is explicit: every folder of modules under app/ and core/ is in it
    on_disk = {"specplay." + ".".join(p.parent.relative_to(ROOT).parts)
               for top in ("app", "core") for p in (ROOT / top).rglob("__init__.py")}
    assert on_disk <= packages, f"packages missing from pyproject.toml: {sorted(on_disk - packages)}"
    assert {dist.package_dir[name] for name in ("specplay.app", "specplay.core", "specplay.assets")} == {
        "app", "core", "assets"}


def test_wheel_carries_every_asset(setuptools_dist):
    _, data = setuptools_dist
    shipped = set(data.get("specplay.assets", []))
    on_disk = _assets_on_disk()
    assert on_disk, "no assets found on disk"
    missing = sorted(str(p.relative_to(ROOT)) for p in on_disk - shipped)
    assert not missing, f"assets the wheel would leave out: {missing}"
    kinds = {p.relative_to(ROOT / "assets").parts[0] for p in shipped}
    assert {"prompts", "icons"} <= kinds


def test_wheel_carries_the_kernels_c_sources_and_header(setuptools_dist):
    """The kernel compiles on the user's machine at first use: every C file beside it must ship."""
    _, data = setuptools_dist
    shipped = set(data.get("specplay.core.kernels", []))
    on_disk = {p.resolve() for p in (ROOT / "core" / "kernels").iterdir() if p.suffix in (".c", ".h")}
    assert {p.suffix for p in on_disk} == {".c", ".h"}
    assert on_disk <= shipped, f"C files the wheel would leave out: {sorted(p.name for p in on_disk - shipped)}"


def test_package_data_globs_cover_heads_before_they_exist():
    globs = bundle_data.asset_globs()
    for needed in ("heads/*.safetensors", "heads/*.json", "training/*.safetensors", "prompts/*.jsonl", "icons/*.png",
                   "icons/*.svg"):
        assert needed in globs


def test_resources_reachable_through_the_package():
    files = importlib.resources.files("specplay.assets")
    assert files.joinpath("prompts", "presets.json").is_file()
    assert any(f.name.endswith(".jsonl") for f in files.joinpath("prompts").iterdir())
    assert files.joinpath("icons", "specplay-256.png").is_file()


def test_sdist_manifest_adds_packaging_and_tests():
    lines = [line.split() for line in (ROOT / "MANIFEST.in").read_text().splitlines()
             if line.strip() and not line.startswith("#")]
    assert ["graft", "packaging"] in lines
    assert ["graft", "tests"] in lines
    assert any(words[:2] == ["recursive-include", "assets"] and "*.safetensors" in words for words in lines)


def _png_header(path: Path) -> tuple[int, int, int]:
    head = path.read_bytes()[:26]
    assert head[:8] == b"\x89PNG\r\n\x1a\n", f"{path.name} is not a PNG"
    assert head[12:16] == b"IHDR"
    width, height = struct.unpack(">II", head[16:24])
    return width, height, head[25]


@pytest.mark.parametrize("size", ICON_SIZES)
def test_icon_png_sizes(size):
    width, height, colour_type = _png_header(ICONS / f"specplay-{size}.png")
    assert (width, height) == (size, size)
    assert colour_type == 6, "icons need an alpha channel (RGBA)"


def test_icon_svg_is_square_svg():
    root = ET.parse(ICONS / "specplay.svg").getroot()
    assert root.tag == "{http://www.w3.org/2000/svg}svg"
    _, _, w, h = (float(v) for v in root.get("viewBox").split())
    assert w == h


def _desktop_entry() -> configparser.SectionProxy:
    parser = configparser.ConfigParser(interpolation=None, strict=True)
    parser.optionxform = str  # keys are case-sensitive
    parser.read_string((PACKAGING / "specplay.desktop").read_text(encoding="utf-8"))
    assert parser.sections()[0] == "Desktop Entry"
    return parser["Desktop Entry"]


def test_desktop_entry_is_valid():
    entry = _desktop_entry()
    for key in ("Type", "Name", "Exec", "Icon", "Categories"):
        assert entry.get(key), f"missing {key}"
    assert entry["Type"] == "Application"
    assert entry["Exec"].split()[0] == "specplay"
    assert entry.get("Terminal", "false") == "false"
    # the icon is a theme name with a PNG of that name in assets/icons
    icon = entry["Icon"]
    assert "/" not in icon and not icon.endswith(".png")
    assert (ICONS / f"{icon}-256.png").is_file()
    categories = entry["Categories"]
    assert categories.endswith(";")
    main = {"AudioVideo", "Audio", "Video", "Development", "Education", "Game", "Graphics", "Network",
            "Office", "Science", "Settings", "System", "Utility"}
    assert main & set(categories.split(";")), "at least one registered main category"
    assert all(v in ("true", "false") for k, v in entry.items() if k in ("Terminal", "StartupNotify"))


def test_spec_takes_assets_and_builds_one_folder():
    spec = (PACKAGING / "specplay.spec").read_text()
    compile(spec, "specplay.spec", "exec")
    assert "bundle_data.asset_datas(ROOT)" in spec
    assert "copy_metadata(_dist)" in spec and "gguf" in bundle_data.METADATA_COPIED
    assert "COLLECT(" in spec and "exclude_binaries=True" in spec  # one folder, not one file
    assert "specplay_main.py" in spec
    assert 'collect_dynamic_libs("llama_cpp")' in spec and '"llama_cpp"' in spec  # the draft engine goes in
    main_script = (PACKAGING / "specplay_main.py").read_text()
    assert "from specplay.app.launcher import main" in main_script
    assert "pathex=[]" in spec  # the installed package is frozen, not the checkout's bare folders
    build = (PACKAGING / "build_app.sh").read_text()
    assert 'pip install --quiet --no-deps --force-reinstall "$ROOT"' in build and " -e " not in build


def test_bundle_datas_carry_every_asset_into_the_assets_package():
    datas = bundle_data.asset_datas()
    sources = {Path(src) for src, _ in datas}
    assert _assets_on_disk() <= sources
    for src, dest in datas:
        rel = Path(src).relative_to(ROOT / "assets")
        assert Path(dest) == Path("specplay", "assets") / rel.parent


def test_bundle_keeps_only_the_qt_modules_the_app_uses():
    excluded = set(bundle_data.qt_excludes())
    for kept in bundle_data.QT_MODULES_KEPT:
        assert f"PySide6.{kept}" not in excluded
    assert {"PySide6.QtNetwork", "PySide6.QtQml", "PySide6.QtQuick", "PySide6.QtWebEngineCore"} <= excluded
    assert bundle_data.drop_from_bundle("PySide6/Qt/translations/qtbase_de.qm")
    assert not bundle_data.drop_from_bundle("PySide6/Qt/plugins/platforms/libqxcb.so")
    # the app's own Qt imports stay within the kept modules
    used = set()
    for path in (ROOT / "app").glob("*.py"):
        for line in path.read_text().splitlines():
            words = line.split()
            if len(words) >= 2 and words[0] == "from" and words[1].startswith("PySide6."):
                used.add(words[1].split(".")[1])
    assert used and used <= set(bundle_data.QT_MODULES_KEPT)


def test_app_imports_without_the_dropped_qt_modules():
    """The window's whole import closure (pyqtgraph, qasync included) loads with the dropped Qt
    modules made unimportable, as in the frozen app."""
    code = f"""
import importlib.abc, sys
DROPPED = {sorted(bundle_data.qt_excludes())!r}
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name in DROPPED:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None
sys.meta_path.insert(0, Block())
import app.window, app.main, qasync
print("ok")
"""
    env = {**os.environ, "QT_QPA_PLATFORM": "offscreen", "QT_API": "pyside6"}
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]


def test_build_script_is_valid_bash():
    script = PACKAGING / "build_app.sh"
    assert os.access(script, os.X_OK)
    subprocess.run(["bash", "-n", str(script)], check=True)
    text = script.read_text()
    assert "packaging/specplay.spec" in text and "pyinstaller" in text


def test_the_build_installs_the_draft_engine_without_its_server(tmp_path):
    """The requirements the build script writes: the runtime dependencies and llama-cpp-python, pinned."""
    script = (PACKAGING / "build_app.sh").read_text()
    program = script.split("<<'PYEOF'\n", 1)[1].split("\nPYEOF", 1)[0]
    out = subprocess.run([sys.executable, "-c", program], cwd=ROOT, capture_output=True, text=True, check=True)
    lines = out.stdout.split()
    assert any(line.startswith("llama-cpp-python==") for line in lines) and not any("[server]" in line for line in lines)
    assert any(line.startswith("torch") for line in lines)


def test_entry_point_calls_freeze_support_first(monkeypatch):
    import multiprocessing

    from specplay.app import launcher

    class Called(Exception):
        pass

    def freeze_support():
        raise Called

    monkeypatch.setattr(multiprocessing, "freeze_support", freeze_support)
    with pytest.raises(Called):
        launcher.main(["models", "list"])  # would run the CLI if freeze_support came later


def test_bundle_drops_tests_translations_and_gpu_runtimes():
    drop = bundle_data.drop_from_bundle
    assert drop("torch/test/atest") and drop("torch/bin/protoc") and drop("torch/bin/test_api")
    assert not drop("torch/bin/torch_shm_manager")  # torch needs it at import time
    assert drop("libcudart.so") and drop("libcublas.so.12")
    assert not drop("torch/lib/libtorch_cpu.so") and not drop("libQt6Gui.so.6")
    assert not drop("assets/prompts/presets.json")


def test_prune_binaries_drops_the_gtk_theme_and_only_its_libraries():
    plugin = bundle_data.GTK3_THEME_PLUGIN
    links = {
        "/x/QtGui.so": {"libQt6Gui.so.6", "libglib-2.0.so.0", "libc.so.6"},
        "/x/libQt6Gui.so.6": {"libglib-2.0.so.0", "libc.so.6"},
        "/x/qgtk3.so": {"libQt6Gui.so.6", "libglib-2.0.so.0", "libpango-1.0.so.0", "libcairo.so.2"},
        "/x/libpango-1.0.so.0": {"libcairo.so.2", "libglib-2.0.so.0"},
        "/x/libcairo.so.2": set(),
        "/x/libglib-2.0.so.0": set(),
        "/x/cudart.so": set(),
    }
    binaries = [
        ("PySide6/QtGui.abi3.so", "/x/QtGui.so", "BINARY"),
        ("libQt6Gui.so.6", "PySide6/Qt/lib/libQt6Gui.so.6", "SYMLINK"),
        ("PySide6/Qt/lib/libQt6Gui.so.6", "/x/libQt6Gui.so.6", "BINARY"),
        (plugin, "/x/qgtk3.so", "BINARY"),
        ("libpango-1.0.so.0", "/x/libpango-1.0.so.0", "BINARY"),
        ("libcairo.so.2", "/x/libcairo.so.2", "BINARY"),
        ("libglib-2.0.so.0", "/x/libglib-2.0.so.0", "BINARY"),
        ("libcudart.so", "/x/cudart.so", "BINARY"),
    ]
    kept, dropped = bundle_data.prune_binaries(binaries, lambda src: links[src])
    assert dropped == sorted([plugin, "libpango-1.0.so.0", "libcairo.so.2", "libcudart.so"])
    assert [e[0] for e in kept] == ["PySide6/QtGui.abi3.so", "libQt6Gui.so.6", "PySide6/Qt/lib/libQt6Gui.so.6",
                                    "libglib-2.0.so.0"]
    # a library the plugin shares with a kept binary stays even when it is only reached indirectly
    links["/x/QtGui.so"] = {"libpango-1.0.so.0"}
    kept, dropped = bundle_data.prune_binaries(binaries, lambda src: links[src])
    assert "libcairo.so.2" not in dropped and "libpango-1.0.so.0" not in dropped


def test_install_desktop_points_the_entry_at_the_program(tmp_path):
    env = {**os.environ, "XDG_DATA_HOME": str(tmp_path), "PATH": "/usr/bin:/bin"}
    script = str(PACKAGING / "install_desktop.sh")
    subprocess.run(["bash", script, "/opt/SpecPlay/SpecPlay"], check=True, env=env, capture_output=True)
    entry = (tmp_path / "applications" / "specplay.desktop").read_text()
    assert "Exec=/opt/SpecPlay/SpecPlay\n" in entry and "TryExec=/opt/SpecPlay/SpecPlay\n" in entry
    for size in ICON_SIZES:
        assert _png_header(tmp_path / "icons" / "hicolor" / f"{size}x{size}" / "apps" / "specplay.png")[:2] == (size, size)
    subprocess.run(["bash", script, "--uninstall"], check=True, env=env, capture_output=True)
    assert not (tmp_path / "applications" / "specplay.desktop").exists()
