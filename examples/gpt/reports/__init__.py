"""What a run reports.

  metrics.py     the metrics log and atomic file writes
  throughput.py  FLOPs per token, the devices' peak, MFU
  report.py      summary.json, the plot, samples and their repetition scores
"""
