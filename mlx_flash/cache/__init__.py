from .neuron_cache import NeuronCache
