"""SpecPlay's desktop app (PySide6 + pyqtgraph + qasync) over :mod:`specplay.core`."""
