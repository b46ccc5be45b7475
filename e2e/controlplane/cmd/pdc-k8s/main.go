// Command pdc-k8s is one binary holding the control-plane servers the e2e
// harness needs, so the large shared dependency graph is linked once.
//
// The component is chosen by the name the binary was invoked as (a symlink
// named kube-apiserver) or by its first argument (pdc-k8s kube-apiserver ...).
package main

import (
	"fmt"
	"os"
	"path/filepath"
	"sort"
	_ "time/tzdata" // CronJob time zones, as in the upstream mains

	"github.com/spf13/cobra"
	"go.etcd.io/etcd/server/v3/etcdmain"
	"k8s.io/component-base/cli"
	_ "k8s.io/component-base/logs/json/register"
	_ "k8s.io/component-base/metrics/prometheus/clientgo"
	_ "k8s.io/component-base/metrics/prometheus/version"
	apiserver "k8s.io/kubernetes/cmd/kube-apiserver/app"
	controllermanager "k8s.io/kubernetes/cmd/kube-controller-manager/app"
	scheduler "k8s.io/kubernetes/cmd/kube-scheduler/app"
)

// cobraComponents build a fresh command per run; their flags live on it.
var cobraComponents = map[string]func() *cobra.Command{
	"kube-apiserver":          apiserver.NewAPIServerCommand,
	"kube-controller-manager": controllermanager.NewControllerManagerCommand,
	"kube-scheduler":          func() *cobra.Command { return scheduler.NewSchedulerCommand() },
}

func componentNames() []string {
	names := []string{"etcd"}
	for name := range cobraComponents {
		names = append(names, name)
	}
	sort.Strings(names)
	return names
}

func isComponent(name string) bool {
	_, ok := cobraComponents[name]
	return ok || name == "etcd"
}

func main() {
	// args[0] is the component name from here on, whichever way it was chosen.
	args := os.Args
	args[0] = filepath.Base(args[0])
	if !isComponent(args[0]) {
		if len(args) < 2 || !isComponent(args[1]) {
			fmt.Fprintf(os.Stderr, "usage: %s COMPONENT [flags]\ncomponents: %v\n",
				args[0], componentNames())
			os.Exit(2)
		}
		args = args[1:]
	}
	if args[0] == "etcd" {
		etcdmain.Main(args)
		return
	}
	command := cobraComponents[args[0]]()
	command.SetArgs(args[1:])
	os.Exit(cli.Run(command))
}
