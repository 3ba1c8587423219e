"""Starting a cluster's workers on Ray: placement groups, actors, checkpoint shipping."""
