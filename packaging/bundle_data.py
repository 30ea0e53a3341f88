"""What the frozen app carries besides code; shared by packaging/specplay.spec and the tests.

The asset globs are read from pyproject.toml's ``[tool.setuptools.package-data]`` table, so the
wheel, the sdist and the frozen app always carry the same files (trained heads, prompt sets, icons).
Plain Python with no PyInstaller import, so the test suite can check it without building anything.
"""

from __future__ import annotations

import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent

APP_NAME = "SpecPlay"

# The only Qt modules the app uses (QtSvg renders the icon; pyqtgraph imports QtOpenGL and
# QtOpenGLWidgets when it loads); every other PySide6 module is left out.
QT_MODULES_KEPT = ("QtCore", "QtGui", "QtWidgets", "QtSvg", "QtOpenGL", "QtOpenGLWidgets")
QT_MODULES_DROPPED = (
    "Qt3DAnimation", "Qt3DCore", "Qt3DExtras", "Qt3DInput", "Qt3DLogic", "Qt3DRender", "QtBluetooth",
    "QtCharts", "QtConcurrent", "QtDBus", "QtDataVisualization", "QtDesigner", "QtGraphs", "QtHelp",
    "QtHttpServer", "QtLabsStyleKit", "QtLocation", "QtMultimedia", "QtMultimediaWidgets", "QtNetwork",
    "QtNetworkAuth", "QtNfc", "QtPdf", "QtPdfWidgets", "QtPositioning",
    "QtPrintSupport", "QtQml", "QtQmlFeatures", "QtQuick", "QtQuick3D", "QtQuickControls2", "QtQuickTest",
    "QtQuickWidgets", "QtRemoteObjects", "QtScxml", "QtSensors", "QtSerialBus", "QtSerialPort",
    "QtSpatialAudio", "QtSql", "QtStateMachine", "QtSvgWidgets", "QtTest", "QtTextToSpeech", "QtUiTools",
    "QtWebChannel", "QtWebEngineCore", "QtWebEngineQuick", "QtWebEngineWidgets", "QtWebSockets",
    "QtWebView", "QtXml",
)

# Python packages the app never imports; some are optional imports of its dependencies that a build
# environment might happen to have. Left out of the analysis so they cannot creep into the bundle.
EXCLUDED_PACKAGES = (
    "tkinter", "_tkinter", "turtle", "idlelib", "test", "unittest.test", "lib2to3", "pydoc_data",
    "tests", "pytest", "_pytest", "pytestqt", "hypothesis", "IPython", "jupyter", "notebook",
    "matplotlib", "scipy", "pandas", "sklearn", "PIL", "cv2", "OpenGL", "h5py", "numba",
    "PyQt5", "PyQt6", "PySide2", "torchvision", "torchaudio", "tensorboard", "tensorflow", "jax",
    "triton", "onnx", "onnxruntime", "deepspeed", "bitsandbytes", "pyinstaller", "PyInstaller",
    "hf_xet",  # huggingface_hub's download accelerator: the app never downloads
)


# Distributions whose metadata the frozen app must carry besides what the contrib hooks copy:
# transformers reads gguf's version (importlib.metadata) before it converts a .gguf file.
METADATA_COPIED = ("gguf",)


def asset_globs(pyproject: Path = ROOT / "pyproject.toml") -> list[str]:
    """The ``specplay.assets`` package-data globs, relative to assets/."""
    with open(pyproject, "rb") as f:
        table = tomllib.load(f)
    return list(table["tool"]["setuptools"]["package-data"]["specplay.assets"])


def asset_files(root: Path = ROOT) -> list[Path]:
    """Every file under assets/ that the globs match (what the wheel carries), sorted."""
    base = root / "assets"
    found = {p for pattern in asset_globs(root / "pyproject.toml") for p in base.glob(pattern) if p.is_file()}
    return sorted(found)


def asset_datas(root: Path = ROOT) -> list[tuple[str, str]]:
    """PyInstaller ``datas`` entries (source file, destination folder in the bundle) for the assets.

    They land in ``_internal/specplay/assets/...`` beside the frozen ``specplay.assets`` package,
    which is where ``specplay.core.paths.assets_dir()`` looks.
    """
    base = root / "assets"
    return [(str(p), str(Path("specplay", "assets") / p.parent.relative_to(base))) for p in asset_files(root)]


def qt_excludes() -> list[str]:
    return [f"PySide6.{name}" for name in QT_MODULES_DROPPED]


# System CUDA/ROCm runtimes a build machine may have: torch's ctypes look-ups can resolve them, but
# the CPU wheel has no use for them (and they are not ours to redistribute).
GPU_RUNTIME_PREFIXES = ("libcuda", "libcudart", "libcublas", "libcudnn", "libcufft", "libcurand", "libcusolver",
                        "libcusparse", "libnccl", "libnvrtc", "libnvJitLink", "libnvToolsExt", "libamdhip",
                        "libhiprtc", "librocm")
# torch/bin holds C++ test programs and protoc besides the one helper torch needs at import time.
TORCH_BIN_KEPT = ("torch_shm_manager",)
# Qt's GTK3 platform theme plugin: it links the desktop's own libgtk-3 (not bundled), which would
# then run against the bundle's copies of glib, pango and cairo: a known source of crashes. Without
# it Qt falls back to its generic theme; with it gone, so are the libraries only it needs.
GTK3_THEME_PLUGIN = "PySide6/Qt/plugins/platformthemes/libqgtk3.so"


def drop_from_bundle(dest_name: str) -> bool:
    """Files the hooks collect that the app has no use for: Qt's translations (the app is English only),
    torch's C++ test programs, protoc, and system GPU runtimes.

    Shared libraries in general are not filtered by name: PyInstaller follows the real link
    dependencies of what is kept (QtGui needs libQt6DBus on Linux, for one), and the dropped Qt
    modules' own extension modules never enter the analysis because they are excluded.
    """
    name = dest_name.replace("\\", "/")
    if name.startswith("PySide6/Qt/translations/") or name.startswith("torch/test/"):
        return True
    if name.startswith("torch/bin/"):
        return name.split("/")[2] not in TORCH_BIN_KEPT
    return "/" not in name and name.startswith(GPU_RUNTIME_PREFIXES)


def prune_binaries(binaries, imports_of) -> tuple[list, list[str]]:
    """Drop what ``drop_from_bundle`` names, the GTK3 theme plugin and the libraries only that plugin needs.

    ``binaries`` are PyInstaller TOC entries ``(dest, src, typecode)``; ``imports_of(src)`` names the
    libraries a binary loads (on Linux, ldd's list, which is transitive). Top-level entries (no folder
    in ``dest``) are the libraries PyInstaller pulled in as dependencies; one is kept if anything
    other than the plugin needs it. Returns the kept entries and the dropped names.
    """
    entries = [tuple(e) for e in binaries]
    dropped = {e[0] for e in entries if e[0] != GTK3_THEME_PLUGIN and drop_from_bundle(e[0])}
    plugin = [e for e in entries if e[0] == GTK3_THEME_PLUGIN]
    if plugin:
        dropped.add(GTK3_THEME_PLUGIN)
        needed = set()
        for dest, src, kind in entries:
            if kind == "SYMLINK" or dest in dropped:
                continue
            if "/" in dest:  # collected on purpose: it and its dependencies stay
                needed.add(dest.rsplit("/", 1)[-1])
                needed.update(imports_of(src))
        # a dependency library stays if a kept binary needs it, directly or through another library
        changed = True
        while changed:
            changed = False
            for dest, src, kind in entries:
                if kind != "SYMLINK" and "/" not in dest and dest in needed:
                    more = set(imports_of(src)) - needed
                    if more:
                        needed |= more
                        changed = True
        for name in imports_of(plugin[0][1]):
            if name not in needed and any(e[0] == name for e in entries):
                dropped.add(name)
    kept = []
    for dest, src, kind in entries:
        target = src.rsplit("/", 1)[-1] if kind == "SYMLINK" else None
        if dest in dropped or (target and (target in dropped or src in dropped)):
            continue
        kept.append((dest, src, kind))
    return kept, sorted(dropped)
