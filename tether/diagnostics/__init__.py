"""Diagnostics: the health bands and live monitor (``health``, D1/D3), ``tether doctor`` (``doctor``,
D2), ``tether report`` (``report``, D4) and ``tether plan`` (``plan``, C1). They read metrics and
configs; they train nothing.

May import: ``tether.core`` and the shared modules — never ``tether.rm``, ``tether.ppo`` or
``tether.demo`` (a run is read from its files, so the doctor works on a run made by any version).
"""
