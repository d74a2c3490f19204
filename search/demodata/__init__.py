"""Building the bundled demo dataset (`latentsweep data build-demo`): a pipeline of the top layer, beside the CLI that
calls it (Debian packages, SVG rendering, two encoders); it writes trainers/data/demo_data/, which trainers/data/demo.py finds."""
