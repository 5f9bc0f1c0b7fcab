"""The models an app serves: their configuration, what the ingress keeps of each, names
to models and adapters, where replicas fit, and when models load and unload."""
