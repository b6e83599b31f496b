module mkernel

go 1.19
