"""The ``detjac`` command line (click). Thin: parse, call the engine/store/analysis, print."""
