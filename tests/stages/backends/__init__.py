"""Back ends against the float64 reference: TVM kernels, schedules, builds, sharing, fast math; ONNX export."""
