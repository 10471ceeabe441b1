"""Pyro code written the way users write it: gallery, styles, guides, spellings, lifecycles, mistakes, user state."""
