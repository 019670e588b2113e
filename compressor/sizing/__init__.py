"""What every format's size plan shares: the interface a format's size target implements (:mod:`.target`),
each weight's statistics and the closed form of its price (:mod:`.sites`), the plan chosen within a byte budget
(:mod:`.plan`), and the budget (:mod:`.budget`). A format's own options, bytes and anchor are in its package
(:mod:`compressor.output.gguf.target`, :mod:`compressor.output.ctensors.target`); the size stage that runs them
is :mod:`compressor.pipeline.size`."""
