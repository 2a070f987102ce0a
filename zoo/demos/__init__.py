"""What the Gradio Spaces build on: components turned into Space controls and runs. Imports the rooms below
the command line."""
from zoo import submodules

__getattr__ = submodules(__name__)
