module mkernel-example-allreduce

go 1.19

require mkernel v0.0.0

replace mkernel => ../../bindings/go/mkernel
