"""The back ends: the NumPy float64 reference, the ONNX exporter and the TVM (Relax) compiler."""
