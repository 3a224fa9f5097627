"""Take a trained encoder out of a raycl checkpoint (issue 35).

`encoder` rebuilds a trial's evaluation embedding from its checkpoint, `formats` writes it
in a format plain PyTorch / torchvision / timm / safetensors / open_clip code loads, and
`model_card` writes the JSON that says how; `modules` holds what they share (Preprocessing,
the MCL concat module). Importing this package stays light: the
submodules import torch themselves.
"""
