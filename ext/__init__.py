"""Hot paths: each as a pure-Python reference (`*_py.py`), a Cython build (`_*_c.pyx`) and a selector (`*.py`).

Set SWITCHYARD_NO_EXTENSIONS=1 to force the Python references. Nothing here imports from `switchyard.router`.
"""
