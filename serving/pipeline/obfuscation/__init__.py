"""Token obfuscation: the keyed vocabulary mapping and the engine boundary where ids turn physical and back."""
