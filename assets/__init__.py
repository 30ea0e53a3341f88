"""Data shipped with SpecPlay: trained draft heads, prompt sets and icons (a package so wheels carry it)."""
