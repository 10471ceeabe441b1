"""Helpers shared by the tests and the benchmarks.

* :mod:`.builders`: PFP layer graphs built directly (no Pyro), hypothesis strategies, test inputs,
  the float32 error bound of compute layers, and a torch model that uses every PFP op.
* :mod:`.stats`: Monte Carlo moment checks with bounds from the sample count.
* :mod:`.op_coverage`: ``@covers`` -- which tests check which op (read by test_op_completeness).
* :mod:`.tir`: looking into compiled IRModules (imports TVM).
* :mod:`.backends`: onnxruntime runs of a network and the back-end-vs-reference tolerance check.
* :mod:`.cli_mlp`: the briefly trained MNIST MLP the CLI tests read (session fixture ``trained``).
* :mod:`.gallery_models`, :mod:`.lifecycle_worker`: Pyro models written the way users write them,
  also run as scripts in fresh processes by test_gallery and test_lifecycle.
"""
