"""harbor_async: async-native episode engine for Harbor sandboxes."""
