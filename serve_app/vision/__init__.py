"""Images in API requests: decoded and limited at the ingress, prompted by the model's processor."""
