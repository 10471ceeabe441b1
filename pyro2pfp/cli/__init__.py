"""The ``pyro2pfp`` command line: convert a trained Pyro BNN to a compiled library or ONNX file,
inspect it, run it on saved inputs, score datasets on Ray Data and benchmark it.  See ``pyro2pfp --help``.

:mod:`~.parser` builds the argument parser, :mod:`~.commands` holds one function per command,
:mod:`~.files` the files they read and write, and :mod:`~.app` the entry point :func:`main`.  Loading a
builder and a param store is library code (:mod:`pyro2pfp.frontend.loading`), as is running an ONNX model
(:func:`pyro2pfp.load`).
"""
from __future__ import annotations

from ..frontend.loading import DEFAULT_FUNCTION, build_model_and_guide, load_builder, load_param_store
from .app import main
from .commands import (
    _tune_spec,
    cmd_bench,
    cmd_convert,
    cmd_diagnose,
    cmd_inspect,
    cmd_predict,
    cmd_validate,
    convert_from_args,
)
from .files import LIBRARY_EXTS, CLIError, load_array, load_example, load_predictor
from .parser import (
    BUILDER_HELP,
    MAIN_DESCRIPTION,
    MAIN_EPILOG,
    build_parser,
    non_negative_float,
    parse_int_list,
    parse_shape,
    positive_float,
    positive_int,
)
from .score import cmd_score

__all__ = ["BUILDER_HELP", "DEFAULT_FUNCTION", "LIBRARY_EXTS", "MAIN_DESCRIPTION", "MAIN_EPILOG", "CLIError",
           "build_model_and_guide", "build_parser", "cmd_bench", "cmd_convert", "cmd_diagnose", "cmd_inspect",
           "cmd_predict", "cmd_score", "cmd_validate", "convert_from_args", "load_array", "load_builder",
           "load_example", "load_param_store", "load_predictor", "main", "non_negative_float", "parse_int_list",
           "parse_shape", "positive_float", "positive_int", "_tune_spec"]
