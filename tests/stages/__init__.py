"""convert's options and stages: tracing, posterior reading, planning, folding; correlation and back ends
in sub-folders."""
