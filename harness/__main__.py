from harness.entry import shardbench

shardbench()
