namespace zinf {}
