"""Process groups and collectives: the mesh of groups, counted collectives, what happens when ranks part."""
