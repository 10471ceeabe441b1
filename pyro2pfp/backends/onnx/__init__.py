"""The ONNX exporter."""
