"""Offline models of attention, beside the runtime: the HBM-traffic model (`traffic`) and differentiable
attention for training (`training`). Nothing the engine runs imports them."""
