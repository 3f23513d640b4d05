"""Quantized weights: the linear methods of each format and the offline quantizers."""
