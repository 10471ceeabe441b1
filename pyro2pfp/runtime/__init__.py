"""Running compiled networks: the TVM runtime, predictors, library files, targets, boards, scoring."""
