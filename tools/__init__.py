"""What makes models rather than serves them: the checkpoint makers (random weights in the published shapes
and the test presets), and the demo model: its task set, training (``vlmserve train-demo``), tool-call phase
and the shipped checkpoint (``demo_checkpoint/``, served by default)."""
